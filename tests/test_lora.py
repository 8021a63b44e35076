"""LoRA on every layout equals one process on the same global batch; resume is exact at another layout.

The reference is a plain model with the same adapters (``apply_lora`` without any
parallelism). Weights are trained-like: q/k scaled up (sharp attention) and the adapters
random with B nonzero, so A's gradients are nonzero and a wrong adapter shard, scaling or
missing reduction shows far above the tolerance. Each case checks the loss, every adapter
gradient, that no base parameter has a gradient or optimizer state, the clipped norm, and
after a few AdamW steps the adapters (equal to the reference's) and the base (bit-identical
to where it started).
"""

import os

import pytest
import torch
import torch.distributed as dist

from dist_utils import assert_close, run_distributed
from model_harness import clean_name, full, make_batch, parallel_step, reference_step, small_args
from titan_ulysses.checkpoint.manager import CheckpointManager
from titan_ulysses.distributed.lora import LoRAOptions, apply_lora, init_lora, parameter_counts, resolve_targets
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.utils import clip_grad_norm_, load_full_state_dict
from titan_ulysses.models.llama.model import Transformer
from titan_ulysses.models.llama.parallelize import ParallelizeOptions, parallelize_llama
from titan_ulysses.optim import build_optimizer

SEQ_LEN = 13  # padded by every layout
STEPS = 3
LR = 1e-3
MAX_NORM = 0.05
LORA = LoRAOptions(rank=4, alpha=8.0, targets=resolve_targets("q_proj,k_proj,v_proj,o_proj,w1,w2,w3"))


def trained_like_reference(args, lora: LoRAOptions = LORA) -> Transformer:
    """A plain model with adapters, its weights far from init (same on every rank)."""
    torch.manual_seed(0)
    ref = Transformer(args)
    ref.init_weights()
    with torch.no_grad():
        for layer in ref.layers.values():
            layer.attention.wq.weight.mul_(4)
            layer.attention.wk.weight.mul_(4)
    apply_lora(ref, lora, torch.float32)
    init_lora(ref, seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return ref


def parallel_twin(ref, args, pd: ParallelDims, options: ParallelizeOptions):
    with torch.device("meta"):
        model = Transformer(args)
    parallelize_llama(model, pd, options)
    model.to_empty(device="cpu")
    model.init_buffers()
    load_full_state_dict(model, ref.state_dict())
    return model


def _compare(layout: dict, ac_mode: str, compile_: bool, microbatches: int):
    pd = ParallelDims(**layout, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    args = small_args()
    ref = trained_like_reference(args)
    model = parallel_twin(ref, args, pd, ParallelizeOptions(ac_mode=ac_mode, compile=compile_,
                                                            param_dtype=torch.float32, lora=LORA))
    base_before = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.1,
                                foreach=False)
    opt = build_optimizer(model, "AdamW", LR, 0.1, 1e-8, (0.9, 0.999), "cpu")
    ref_params = dict(ref.named_parameters())
    trainable, total = parameter_counts(model)
    assert (trainable, total) == parameter_counts(ref) and 0 < trainable < total / 5
    assert trainable == sum(p.numel() for n, p in ref_params.items() if "lora_" in n)

    for step in range(STEPS):
        inputs, labels = make_batch(step, 4 * microbatches, SEQ_LEN, args.vocab_size)
        ref_loss = reference_step(ref, inputs, labels, microbatches)
        loss, _ = parallel_step(model, pd, inputs, labels, microbatches)
        assert_close(loss.float(), ref_loss.float(), f"step {step} loss")
        adapters = 0
        for name, p in model.named_parameters():
            name = clean_name(name)
            if "lora_" in name:
                assert ref_params[name].grad.abs().max() > 1e-4, f"{name}: a zero gradient proves nothing"
                assert_close(full(p.grad), ref_params[name].grad, f"step {step} grad {name}")
                adapters += 1
            else:
                assert p.grad is None and not p.requires_grad, f"frozen {name} has a gradient"
        assert adapters == len([n for n in ref_params if "lora_" in n]) == 2 * 7 * args.n_layers
        ref_norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], MAX_NORM)
        assert_close(clip_grad_norm_(model.parameters(), MAX_NORM), ref_norm, f"step {step} grad norm")
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert len(opt.state) == adapters  # no optimizer state for the frozen base
    for name, p in model.named_parameters():
        name = clean_name(name)
        if name in base_before:
            assert torch.equal(full(p.detach()), base_before[name]), f"frozen {name} changed"
        else:
            torch.testing.assert_close(full(p.detach()), ref_params[name].detach(), rtol=1e-5, atol=LR * 1e-2,
                                       msg=lambda m: f"adapter {name} after {STEPS} steps: {m}")


CASES = {
    # id: (world size, layout, ac mode, compile, microbatches)
    "sp2": (2, dict(sp=2), "none", False, 1),
    "dp_shard2-sp2": (4, dict(dp_shard=2, sp=2), "none", False, 1),
    "cp2": (2, dict(cp=2), "none", False, 1),
    "sp2-ac-full": (2, dict(sp=2), "full", False, 1),
    "dp_shard2-sp2-accum2-ac-selective": (4, dict(dp_shard=2, sp=2), "selective", False, 2),
    "sp2-compile": (2, dict(sp=2), "none", True, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_lora_layout_matches_single_process(case):
    world, layout, ac_mode, compile_, microbatches = CASES[case]
    run_distributed(_compare, world, layout, ac_mode, compile_, microbatches)


def _train(model, pd, opt, steps):
    losses = []
    for step in steps:
        inputs, labels = make_batch(step, 4, SEQ_LEN, 256)
        loss, _ = parallel_step(model, pd, inputs, labels)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _resume_at_another_layout(folder):
    args = small_args()
    ref = trained_like_reference(args)
    runs = {}
    for name, layout in (("sp2", dict(sp=2)), ("dp_shard2", dict(dp_shard=2))):
        pd = ParallelDims(**layout, world_size=dist.get_world_size())
        pd.build_mesh("cpu")
        model = parallel_twin(ref, args, pd, ParallelizeOptions(param_dtype=torch.float32, lora=LORA))
        opt = build_optimizer(model, "AdamW", LR, 0.1, 1e-8, (0.9, 0.999), "cpu")
        ckpt = CheckpointManager(folder=os.path.join(folder, name), model=model, optimizer=opt, lr_scheduler=opt,
                                 dataloader=opt, enable=True, interval=2)
        runs[name] = (pd, model, opt, ckpt)
    pd, model, opt, ckpt = runs["sp2"]
    first = _train(model, pd, opt, range(2))
    ckpt.save(2)
    uninterrupted = _train(model, pd, opt, range(2, 4))
    # the dp_shard=2 run resumes from the sp=2 run's step 2
    pd, model, opt, ckpt = runs["dp_shard2"]
    assert ckpt.load_from(os.path.join(folder, "sp2", "step-2")) == 2
    resumed = _train(model, pd, opt, range(2, 4))
    assert first[0] != uninterrupted[-1]
    assert_close(torch.tensor(resumed), torch.tensor(uninterrupted), "losses after resume at dp_shard=2")


def test_lora_resume_at_another_layout_is_exact(tmp_path):
    run_distributed(_resume_at_another_layout, 2, str(tmp_path))
