"""A transformers Llama under ``apply_ulysses`` at sp=2 in bf16, on gloo ranks sharing the device,
against one process (``gpu_suite.py --part correctness`` and ``rest``, case ``hf_llama_ulysses_bf16``).

The model, batch and reference are tests/test_hf_ulysses.py's (Llama with 6 q heads over one kv
head, replicated to sp; trained-like weights; packed documents, ignored labels, a length sp does
not divide). The truth is one fp32 process; the bf16 run at sp=2 must be as close to it as one
bf16 process is (within 2x its error + 2e-3, as families_bf16), in loss, logits and each
parameter's gradient; ``bug_logits`` is the same run with positions not offset per rank, to show the
tolerance catches a wrong shard.
"""

from __future__ import annotations

import torch

from benchmarks.gpu_common import exact_fp32, rel_err

from .multirank import spawn


def _sp2_against_one_process(device, seq: int) -> dict:
    """On each of 2 gloo ranks: the worst relative errors against one fp32 process, of one bf16
    process and of the bf16 sp=2 run (logits: each rank's slice; grads: summed over the ranks)."""
    import copy

    import torch.distributed as dist
    from test_hf_ulysses import build, make_batch, reference
    from torch.distributed.device_mesh import init_device_mesh

    from titan_ulysses.integrations.transformers import apply_ulysses, shard_batch, sp_loss

    exact_fp32()
    mesh = init_device_mesh(device.type, (2,), mesh_dim_names=("sp",))
    ref = build("llama-kv1").to(device)
    one = copy.deepcopy(ref).to(torch.bfloat16)
    model = apply_ulysses(copy.deepcopy(one), mesh)
    batch = {k: v.to(device) for k, v in make_batch(ref.config.vocab_size, seq).items()}
    truth_logits, truth_loss = reference(ref, batch)
    one_logits, one_loss = reference(one, batch)

    rank = mesh.get_local_rank()
    local = shard_batch(batch, mesh)
    out = model(input_ids=local["input_ids"], position_ids=local["position_ids"])
    loss = sp_loss(out.logits, local["shift_labels"], mesh)
    loss.backward()
    s_local = local["input_ids"].shape[1]
    start, end = rank * s_local, min((rank + 1) * s_local, seq)
    mine = slice(start, end)  # this rank's tokens, without the padding
    err = {"sp_loss": rel_err(loss.detach(), truth_loss), "one_loss": rel_err(one_loss, truth_loss),
           "sp_logits": rel_err(out.logits.detach()[:, :end - start], truth_logits[:, mine]),
           "one_logits": rel_err(one_logits[:, mine], truth_logits[:, mine]),
           "sp_grad": 0.0, "one_grad": 0.0, "grad_ratio": 0.0}
    truth, one_params = dict(ref.named_parameters()), dict(one.named_parameters())
    for name, p in model.named_parameters():
        g = p.grad.float()
        dist.all_reduce(g)  # the ranks' shares: their sum / sp is one process's gradient (sp_loss)
        sp_err, one_err = rel_err(g / 2, truth[name].grad), rel_err(one_params[name].grad, truth[name].grad)
        err["sp_grad"], err["one_grad"] = max(err["sp_grad"], sp_err), max(err["one_grad"], one_err)
        # per parameter: bf16's error differs by parameter, and the noisiest one's would hide a bug in the others
        err["grad_ratio"] = max(err["grad_ratio"], sp_err / (2 * one_err + 2e-3))
    with torch.no_grad():  # the planted bug: every rank's positions start at 0
        wrong = torch.arange(s_local, device=device).expand_as(local["position_ids"])
        bad = model(input_ids=local["input_ids"], position_ids=wrong).logits
    err["bug_logits"] = rel_err(bad[:, :end - start], truth_logits[:, mine])
    worst = torch.tensor(list(err.values()), device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(zip(err, worst.tolist()))


def hf_llama_ulysses_bf16(ctx):
    seq = 25 if ctx.dry_run else 1001  # neither divisible by 2: the last rank holds padding
    res = spawn(2, "gloo", ctx.device.type, (_sp2_against_one_process, seq), ctx.timeout(120))
    if "error" in res:
        return {"status": "fail", "figures": res, "detail": res["error"]}
    tol = {k: 2 * res[f"one_{k}"] + 2e-3 for k in ("loss", "logits")}
    ok = all(res[f"sp_{k}"] <= t for k, t in tol.items()) and res["grad_ratio"] <= 1
    ok &= res["bug_logits"] > 10 * tol["logits"]
    return {"status": "pass" if ok else "fail", "figures": res,
            "detail": f"transformers Llama (6 q heads / 1 kv head, 2 layers, trained-like weights), 2 x {seq} tokens "
                      "with packed documents, apply_ulysses sp=2 in bf16 on gloo ranks sharing the device vs one fp32 "
                      "process; loss, logits and each parameter's grad within 2x one bf16 process's error + 2e-3 (rel.; "
                      "grad_ratio: the worst parameter's error over its tolerance); bug_logits: "
                      "positions not offset per rank, must exceed 10x the logits tolerance"}
