"""Context parallelism (``cp``, all-gather of K/V) alone and beside Ulysses equals one process.

Each layout case checks this rank's logits (mapped back through the load-balanced order),
the loss, every parameter gradient and the parameters after AdamW steps (fp32, rtol 1e-5),
with S = 13 (every case pads) and GQA (8 q heads with 2 kv heads; 6 q heads with 1 kv head,
replicated for sp, a head count that Ulysses alone cannot split over the same 4 ranks).
Layouts: cp4, cp2 with packed documents (the dense-mask path) and full activation
checkpointing, cp2 x sp2, dp_shard2 x cp2 with full checkpointing, cp2 x tp2. Not covered
here: torch.compile with cp; selective checkpointing with cp is refused (see below).
"""

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention.bias import causal_lower_right

from dist_utils import assert_close, run_distributed
from model_harness import assert_params_match, build_pair, clean_name, full, small_args
from titan_ulysses.config.manager import ConfigError, load_config, validate
from titan_ulysses.data.sharding import check_seq_len, load_balanced_order, shard_batch
from titan_ulysses.distributed.context_parallel import cp_mask
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.utils import dist_sum, global_token_count
from titan_ulysses.models.llama.parallelize import ParallelizeOptions
from titan_ulysses.ops.attention import build_attention_mask
from titan_ulysses.ops.loss import IGNORE_INDEX, cross_entropy_sum

SEQ_LEN = 13  # padded to 16 by 2 x cp x sp = 4 or 8
STEPS = 2
LR = 1e-3


def _batch(step: int, vocab: int, packed: bool):
    """A global batch of 4 rows; with ``packed``, documents of random lengths and their positions."""
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, vocab, (4, SEQ_LEN + 1), generator=g)
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    labels[torch.rand(4, SEQ_LEN, generator=g) < 0.3] = IGNORE_INDEX
    labels[0, : SEQ_LEN // 2] = IGNORE_INDEX
    if not packed:
        return inputs, labels, None, None
    starts = torch.rand(4, SEQ_LEN, generator=g) < 0.25
    starts[:, 0] = True
    docs = starts.long().cumsum(1) - 1  # [4, S]
    index = torch.arange(SEQ_LEN).expand(4, SEQ_LEN)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(1).values
    return inputs, labels, docs, index - first  # positions restart in every document


def _compare(layout: dict, overrides: dict, packed: bool, ac_mode: str = "none"):
    pd = ParallelDims(**layout, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    args = small_args(**overrides)
    ref, model = build_pair(args, pd, ParallelizeOptions(param_dtype=torch.float32, ac_mode=ac_mode))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    ref_params = dict(ref.named_parameters())
    dp, dp_rank = pd.get_mesh("dp").size(), pd.get_mesh("dp").get_local_rank()
    sp, sp_rank = pd.get_mesh("sp").size(), pd.get_mesh("sp").get_local_rank()
    cp, cp_rank = pd.get_mesh("cp").size(), pd.get_mesh("cp").get_local_rank()
    loss_mesh = pd.get_mesh("loss")

    for step in range(STEPS):
        inputs, labels, docs, positions = _batch(step, args.vocab_size, packed)
        ref_mask = build_attention_mask("sdpa", docs)
        ref_logits = ref(inputs, positions=positions, attention_mask=ref_mask)
        ref_loss = cross_entropy_sum(ref_logits, labels) / (labels != IGNORE_INDEX).sum()
        ref_loss.backward()

        rows = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)
        mb = shard_batch(inputs[rows], labels[rows], sp_rank, sp,
                         positions=None if positions is None else positions[rows],
                         document_ids=None if docs is None else docs[rows], cp_rank=cp_rank, cp=cp)
        n_tokens = global_token_count([mb.labels], loss_mesh)
        out = model(mb.tokens, positions=mb.positions, attention_mask=build_attention_mask("sdpa", mb.document_ids))
        loss = cross_entropy_sum(out, mb.labels) / n_tokens
        loss.backward()
        assert_close(dist_sum(loss.detach(), loss_mesh).float(), ref_loss.detach().float(), f"step {step} loss")

        real = mb.index < SEQ_LEN  # this rank's tokens that are not padding, wherever they sit
        assert_close(out.detach()[:, real], ref_logits.detach()[rows][:, mb.index[real]], f"step {step} logits")
        grads = {clean_name(n): full(p.grad) for n, p in model.named_parameters()}
        assert grads.keys() == ref_params.keys()
        for name, g in grads.items():
            assert_close(g, ref_params[name].grad, f"step {step} grad {name}")
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()

    assert_params_match(model, ref_params, LR, STEPS)


CASES = {
    # id: (world size, layout, model overrides, packed documents)
    "cp4": (4, dict(cp=4), {}, False),  # 8 chunks: ranks hold (0, 7), (1, 6), (2, 5), (3, 4)
    "cp2-packed-documents-ac-full": (2, dict(cp=2), {}, True, "full"),  # the all-gather recomputed in backward
    # 6 heads: Ulysses cannot split them over 4 ranks (refused, naming 2 x 2), cp x sp can; 1 kv head replicated for sp
    "cp2-sp2-6heads-kv-replicated": (4, dict(cp=2, sp=2), dict(dim=48, n_heads=6, n_kv_heads=1), False),
    "dp_shard2-cp2-ac-full": (4, dict(dp_shard=2, cp=2), {}, False, "full"),
    "cp2-tp2": (4, dict(cp=2, tp=2), {}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cp_layout_matches_single_process(case):
    world, layout, overrides, packed, *ac_mode = CASES[case]
    run_distributed(_compare, world, layout, overrides, packed, *ac_mode)


def _pairs(q_index: torch.Tensor, k_index: torch.Tensor) -> int:
    return int((q_index[:, None] >= k_index[None, :]).sum())


@pytest.mark.parametrize("cp", [2, 4])
def test_balanced_order_gives_every_cp_rank_the_same_causal_work(cp):
    s = 64
    local = s // cp
    # unmasked (q, k) pairs per cp rank: by global indices (the mask packed documents refine) ...
    balanced = [int(cp_mask(None, r, cp, local, "cpu").sum()) for r in range(cp)]
    assert len(set(balanced)) == 1, balanced
    # ... and what the causal path scores: each chunk against the prefix ending with it
    chunk = s // (2 * cp)
    biases = [[causal_lower_right(chunk, (c + 1) * chunk) for c in (r, 2 * cp - 1 - r)] for r in range(cp)]
    assert [sum(int(b._materialize().sum()) for b in pair) for pair in biases] == balanced
    assert sum(balanced) == s * (s + 1) // 2  # every causal pair scored once, on one rank
    # a plain contiguous split: the last rank does cp*2-1 times the first rank's work
    keys = torch.arange(s)
    plain = [_pairs(torch.arange(r * local, (r + 1) * local), keys) for r in range(cp)]
    assert plain == sorted(plain) and plain[-1] > 2 * plain[0], plain
    assert sum(plain) == sum(balanced)
    # the order itself: rank r holds chunks r and 2cp-1-r
    held = load_balanced_order(s, cp).view(cp, 2, chunk)[:, :, 0] // chunk
    assert held.tolist() == [[r, 2 * cp - 1 - r] for r in range(cp)]


def test_cp_refusals_name_the_settings():
    with pytest.raises(ValueError, match=r"^seq_len 1000 is not divisible by 2 x context_parallel_degree x "
                                         r"ulysses_degree = 2 x 3 x 2 = 12 .*; use seq_len 996 or 1008$"):
        check_seq_len(1000, sp=2, cp=3)
    tokens = torch.zeros(1, 12, dtype=torch.long)
    with pytest.raises(ValueError, match=r"seq_len 12 is not divisible by 2 x context_parallel_degree"):
        shard_batch(tokens, tokens, 0, 2, pad=False, cp_rank=0, cp=2)
    with pytest.raises(ValueError, match=r"^data_parallel_shard_degree 2 x context_parallel_degree 2 x ulysses_degree 2 "
                                         r"= 8, but the world size is 4"):
        ParallelDims(dp_shard=2, cp=2, sp=2, world_size=4)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by .*context_parallel_degree.* = 1 x 4 x 1 x 1 = 4"):
        ParallelDims(cp=4, world_size=6)
    with pytest.raises(ValueError, match="context_parallel_degree 0 must be >= 1"):
        ParallelDims(cp=0, world_size=2)
    base = ["--config", "train_configs/debug_model.toml", "--parallelism.ulysses_degree", "2",
            "--parallelism.context_parallel_degree", "2"]
    with pytest.raises(ConfigError, match=r"^training.seq_len: seq_len 1001 is not divisible by 2 x "
                                          r"context_parallel_degree x ulysses_degree = 2 x 2 x 2 = 8"):
        validate(load_config(base + ["--training.seq_len", "1001"]), 4)
    with pytest.raises(ConfigError, match=r"^parallelism: .*context_parallel_degree 2 .* = 4, but the world size is 8"):
        validate(load_config(base + ["--parallelism.data_parallel_shard_degree", "1"]), 8)
    with pytest.raises(ConfigError, match=r"context_parallel_degree 2 is implemented for model.attn_backend 'sdpa' only"):
        validate(load_config(base + ["--model.attn_backend", "flex"]), 4)
    with pytest.raises(ConfigError, match=r"activation_checkpoint.mode 'selective' does not work with "
                                          r"parallelism.context_parallel_degree 2"):
        validate(load_config(base + ["--activation_checkpoint.mode", "selective"]), 4)
    pd = validate(load_config(base), 8)
    assert pd.degrees == {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "sp": 2, "tp": 1}
    assert pd.size("fsdp_shard") == 8 and pd.size("dp_shard_sp") == 8 and pd.size("loss") == 8
    assert pd.size("dp") == 2 and pd.size("seq") == 4


def test_heads_ulysses_cannot_split_name_the_cp_splits_that_work():
    from titan_ulysses.distributed.ulysses import check_heads

    # more ranks per sequence than heads: Ulysses alone cannot, cp x sp can (even splits named first)
    with pytest.raises(ValueError, match=r"ulysses_degree 8 is larger than the 6 attention heads .*; to split each "
                                         r"sequence over 8 ranks, use ulysses_degree x context_parallel_degree = "
                                         r"2 x 4, 1 x 8$"):
        check_heads(6, 1, sp=8, tp=1)
    check_heads(6, 1, sp=2, tp=1, cp=4)
    check_heads(28, 4, sp=4, tp=1, cp=2)  # Qwen2.5-7B over 8 ranks, evenly (sp=8 also works, unevenly)
    # the config names the settings (debugmodel: 16 heads)
    with pytest.raises(ConfigError, match=r"^parallelism.ulysses_degree / tensor_parallel_degree: ulysses_degree 32 "
                                          r".*to split each sequence over 64 ranks, use ulysses_degree x "
                                          r"context_parallel_degree = 16 x 4, 8 x 8"):
        validate(load_config(["--config", "train_configs/debug_model.toml", "--parallelism.ulysses_degree", "32",
                              "--parallelism.context_parallel_degree", "2", "--training.seq_len", "2048"]), 64)


def test_cp_refuses_backends_it_does_not_implement():
    from titan_ulysses.distributed.context_parallel import ContextParallelAttention
    from titan_ulysses.ops.attention import FlexAttention

    class OneRankMesh:  # the backend check comes before any process group is touched
        ndim = 1

    with pytest.raises(NotImplementedError, match="attn_backend 'sdpa' only, not FlexAttention"):
        ContextParallelAttention(FlexAttention(), OneRankMesh())  # type: ignore[arg-type]


def test_trainer_runs_context_parallel_through_torchrun(tmp_path):
    """A run written at ulysses_degree 2 resumes through torchrun at ``--parallelism.context_parallel_degree 2``
    and its step equals one process's (weights, optimizer and data position carried across layouts)."""
    import json
    import os
    import subprocess
    import sys

    from test_trainer import BASE, layout, losses, run

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "100"]
    ref = losses(run(1, ["--training.steps", "3"] + layout(), tmp_path, "single"))
    first = losses(run(2, ["--training.steps", "2"] + ckpt + layout(sp=2), tmp_path, "resumed"))
    folder = tmp_path / "resumed"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
         *BASE, "--training.steps", "3", *ckpt, *layout(), "--parallelism.context_parallel_degree", "2",
         "--job.dump_folder", str(folder)],
        cwd=root, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'cp': 2" in proc.stdout and "starting at step 2" in proc.stdout
    with open(folder / "metrics.jsonl") as f:
        resumed = losses([json.loads(line) for line in f])
    for s in range(1, 4):
        got = first[s] if s < 3 else resumed[s]
        assert got == pytest.approx(ref[s], rel=1e-5), f"step {s}: {got} vs {ref[s]}"


def test_estimator_and_comm_model_know_cp():
    import dataclasses

    from titan_ulysses.metrics.comm import context_parallel_bytes_per_step, ulysses_bytes_per_step
    from titan_ulysses.metrics.memory_estimate import GIB, Layout, Switches, estimate
    from titan_ulysses.metrics.memory_fit import recommend
    from titan_ulysses.models.llama.args import get_flavor

    args = get_flavor("debugmodel")  # 6 layers, 16 heads, 4 kv heads, head_dim 16
    # cp=2 x sp=4 over 4096 tokens: after Ulysses a rank holds 2048 tokens of 4/4 = 1 kv head;
    # the ring all-gather sends 1 block of k and v per layer and pass (backward: reduce-scatter)
    per_pass = 2048 * 2 * 1 * 16 * 4
    assert context_parallel_bytes_per_step(args, 4096, 1, 2, 4, 1, 4, False) == pytest.approx(6 * 2 * per_pass)
    assert context_parallel_bytes_per_step(args, 4096, 1, 2, 4, 1, 4, True) == pytest.approx(6 * 3 * per_pass)
    assert context_parallel_bytes_per_step(args, 4096, 1, 1, 8, 1, 4, False) == 0.0
    # Ulysses' share over cp x sp moves half the tokens of sp=4 alone
    assert ulysses_bytes_per_step(args, 4096, 1, 4, 1, 4, False, cp=2) == pytest.approx(
        ulysses_bytes_per_step(args, 4096, 1, 4, 1, 4, False) / 2)

    big = get_flavor("8B")
    sw = Switches()
    sp8, hybrid = estimate(big, Layout(sp=8), sw, 131072), estimate(big, Layout(sp=4, cp=2), sw, 131072)
    assert hybrid.parameters == pytest.approx(sp8.parameters)  # FSDP shards over cp x sp alike
    # same local tokens, plus the K/V prefixes the two chunks attend to, (2cp+1)/2cp of the sequence
    # (bf16: GQA kept, 8 kv heads split over sp 4): per layer 2 bytes x 2 (k, v) x 2 kv heads x 128 x 5/4 x 131072
    extra = big.n_layers * 2 * 2 * 2 * 128 * 5 / 4 * 131072
    assert hybrid.saved_activations - sp8.saved_activations == pytest.approx(extra, rel=0.01)
    # full AC keeps none of it: it comes back only in the recompute of one layer
    full = dataclasses.replace(sw, ac_mode="full")
    assert estimate(big, Layout(sp=4, cp=2), full, 131072).saved_activations == pytest.approx(
        estimate(big, Layout(sp=8), full, 131072).saved_activations)

    # Qwen2.5-7B's shape (28 heads, 4 kv heads): ulysses_degree 8 is impossible on 8 GPUs, so a
    # length that needs 8 ranks per sequence gets ulysses 4 x context_parallel 2
    qwen = get_flavor("8B", dim=3584, n_heads=28, n_kv_heads=4, ffn_hidden_dim=18944, vocab_size=152064)
    rec = recommend(qwen, Layout(dp_shard=8), sw, 2621440, 1, 8, 0.9 * 80 * GIB)
    assert rec is not None and rec[1][:2] == ["--parallelism.ulysses_degree 4",
                                              "--parallelism.context_parallel_degree 2"], rec[1]
    # where Ulysses alone is allowed it is chosen: the 8B (32 heads) at the same length
    rec = recommend(big, Layout(dp_shard=8), sw, 2621440, 1, 8, 0.9 * 80 * GIB)
    assert rec is not None and rec[1][0] == "--parallelism.ulysses_degree 8" and "context" not in " ".join(rec[1])


def test_fake_world_runs_cp_and_reports_its_volume(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from titan_ulysses.metrics.comm import context_parallel_bytes_per_step
    from titan_ulysses.models.llama.args import get_flavor

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "fake"
    proc = subprocess.run(
        [sys.executable, "train.py", "--config", "train_configs/debug_model.toml", "--comm.mode", "fake",
         "--comm.fake_world_size", "8", "--parallelism.ulysses_degree", "4", "--parallelism.context_parallel_degree", "2",
         "--training.seq_len", "1024", "--training.local_batch_size", "1", "--training.steps", "1",
         "--checkpoint.enable", "false", "--job.dump_folder", str(out)],
        cwd=root, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "'cp': 2" in proc.stdout and "'sp': 4" in proc.stdout
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    expected = context_parallel_bytes_per_step(get_flavor("debugmodel"), 1024, 1, 2, 4, 1, 4, False)
    assert metrics[-1]["cp_gib_per_step"] == pytest.approx(expected / 2**30)
