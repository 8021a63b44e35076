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

import extras
from dist_utils import assert_close, run_distributed
from model_harness import clean_name, full, make_batch, parallel_step, reference_step, small_args, split_overrides
from titan_ulysses.interop.peft_export import AdapterMismatchError
from titan_ulysses.checkpoint.manager import CheckpointManager
from titan_ulysses.distributed.float8 import Float8Options, apply_float8, precompute_float8_scales
from titan_ulysses.distributed.lora import LoRAOptions, apply_lora, init_lora, parameter_counts, resolve_targets
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.utils import clip_grad_norm_, load_full_state_dict
from titan_ulysses.models.decoder.model import Transformer
from titan_ulysses.models.decoder.parallelize import ParallelizeOptions, parallelize_decoder
from titan_ulysses.optim import build_optimizer

SEQ_LEN = 13  # padded by every layout
STEPS = 3
LR = 1e-3
MAX_NORM = 0.05
LORA = LoRAOptions(rank=4, alpha=8.0, targets=resolve_targets("q_proj,k_proj,v_proj,o_proj,w1,w2,w3"))


def trained_like_reference(args, lora: LoRAOptions = LORA, float8: Float8Options | None = None,
                           compute=None) -> Transformer:
    """A plain model with adapters, its weights far from init (same on every rank)."""
    torch.manual_seed(0)
    ref = Transformer(args, compute)
    ref.init_weights()
    with torch.no_grad():
        for layer in ref.layers.values():
            layer.attention.wq.weight.mul_(4)
            layer.attention.wk.weight.mul_(4)
    if float8 is not None:
        apply_float8(ref, float8)
    apply_lora(ref, lora, torch.float32)
    init_lora(ref, seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return ref


def parallel_twin(ref, args, pd: ParallelDims, options: ParallelizeOptions, compute=None):
    with torch.device("meta"):
        model = Transformer(args, compute)
    parallelize_decoder(model, pd, options)
    model.to_empty(device="cpu")
    model.init_buffers()
    load_full_state_dict(model, ref.state_dict())
    return model


def _compare(layout: dict, ac_mode: str, compile_: bool, microbatches: int, overrides: dict, extra: dict):
    pd = ParallelDims(**layout, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    overrides, compute = split_overrides(overrides)  # runtime switches (the tiled MLP) are ComputeOptions
    args = small_args(**overrides)
    float8 = extra.pop("float8", None)
    ref = trained_like_reference(args, float8=float8, compute=compute)
    options = ParallelizeOptions(ac_mode=ac_mode, compile=compile_, param_dtype=torch.float32, lora=LORA,
                                 float8=float8, **extra)
    model = parallel_twin(ref, args, pd, options, compute)
    base_before = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.1,
                                foreach=False)
    opt = build_optimizer(model, "AdamW", LR, 0.1, 1e-8, (0.9, 0.999), "cpu")
    ref_params = dict(ref.named_parameters())
    if float8 is not None:  # the frozen base projections compute in float8
        assert {type(m).__name__ for m in model.modules()} >= {"LoRAFloat8Linear"}
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
        if float8:
            precompute_float8_scales(model, float8)
    assert len(opt.state) == adapters  # no optimizer state for the frozen base
    for name, p in model.named_parameters():
        name = clean_name(name)
        if name in base_before:
            assert torch.equal(full(p.detach()), base_before[name]), f"frozen {name} changed"
        else:
            torch.testing.assert_close(full(p.detach()), ref_params[name].detach(), rtol=1e-5, atol=LR * 1e-2,
                                       msg=lambda m: f"adapter {name} after {STEPS} steps: {m}")


TILED = dict(mlp_tile_size=3)
CASES = {
    # id: (world size, layout, ac mode, compile, microbatches, model overrides, other parallelize options)
    "sp2": (2, dict(sp=2), "none", False, 1, {}, {}),
    "dp_shard2-sp2": (4, dict(dp_shard=2, sp=2), "none", False, 1, {}, {}),
    "cp2": (2, dict(cp=2), "none", False, 1, {}, {}),
    "dp_shard2-sp2-accum2-ac-selective": (4, dict(dp_shard=2, sp=2), "selective", False, 2, {}, {}),
    "sp2-compile": (2, dict(sp=2), "none", True, 1, {}, {}),
    # full AC (with its input offloaded), tiled MLP, FSDP CPU offload
    "sp2-tiled-mlp-ac-offload-fsdp-offload": (2, dict(sp=2), "full_offload", False, 1, TILED, dict(cpu_offload=True)),
    # the frozen base computes in float8 (emulated on CPU), the adapters in high precision; rowwise
    # scales are per token, so a sequence split quantizes exactly as one process does
    "sp2-float8-rowwise": (2, dict(sp=2), "none", False, 1, {},
                              dict(float8=Float8Options(recipe="rowwise", emulate=True))),
}
NEEDS = {"sp2-float8-rowwise": extras.needs("torchao")}


@pytest.mark.parametrize("case", [pytest.param(c, marks=NEEDS.get(c, ())) for c in CASES])
def test_lora_layout_matches_single_process(case):
    world, layout, ac_mode, compile_, microbatches, overrides, extra = CASES[case]
    run_distributed(_compare, world, layout, ac_mode, compile_, microbatches, overrides, extra)


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
    # resuming with other [lora] settings is refused in one line, and the checkpoint is not set aside
    for lora in (None, LoRAOptions(rank=2, alpha=8.0)):
        with torch.device("meta"):
            other = Transformer(args)
        parallelize_decoder(other, pd, ParallelizeOptions(param_dtype=torch.float32, lora=lora))
        other.to_empty(device="cpu")
        opt = build_optimizer(other, "AdamW", LR, 0.1, 1e-8, (0.9, 0.999), "cpu")
        ckpt = CheckpointManager(folder=os.path.join(folder, "sp2"), model=other, optimizer=opt, lr_scheduler=opt,
                                 dataloader=opt, enable=True, interval=2)
        rank = lora.rank if lora else 0
        with pytest.raises(AdapterMismatchError, match=f"written with lora.rank 4, this run has lora.rank {rank} "):
            ckpt.load()
        assert os.path.isdir(os.path.join(folder, "sp2", "step-2"))


def test_lora_resume_at_another_layout_is_exact(tmp_path):
    run_distributed(_resume_at_another_layout, 2, str(tmp_path))


@pytest.mark.parametrize("argv, refusal", [
    (["--lora.target_modules", "q_proj,qkv_proj"],
     "lora.target_modules: unknown module 'qkv_proj'; valid: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
     "down_proj (or ours: wq, wk, wv, wo, w1, w3, w2)"),
    (["--lora.target_modules", " , "], "lora.target_modules: is empty; valid: q_proj"),
    (["--lora.rank", "-1"], "lora.rank must be >= 0, got -1"),
    (["--lora.dropout", "1.0"], "lora.dropout must lie in [0, 1), got 1.0"),
    (["--lora.alpha", "0"], "lora.alpha must be positive, got 0.0"),
    (["--lora.rank", "8", "--parallelism.tensor_parallel_degree", "2"],
     "lora.rank 8 with parallelism.tensor_parallel_degree 2 is not supported"),
    (["--lora.rank", "8", "--lora.dropout", "0.1", "--model.mlp_tile_size", "64"],
     "lora.dropout 0.1 with model.mlp_tile_size 64: the tiled MLP recomputes"),
    # rank 0 is a full fine-tune: other [lora] settings beside it contradict it (it ran silently before)
    (["--lora.rank", "0", "--lora.alpha", "64"],
     "lora.rank 0 turns LoRA off (a full fine-tune of every weight), yet lora.alpha 64.0 is set; set lora.rank > 0 "
     "to train adapters, or remove the other [lora] settings for a full fine-tune"),
    (["--lora.dropout", "0.05", "--lora.target_modules", "q_proj,v_proj"],
     "lora.rank 0 turns LoRA off (a full fine-tune of every weight), yet lora.dropout 0.05, lora.target_modules "
     "'q_proj,v_proj' are set"),
])
def test_lora_settings_refused_before_any_process_group(argv, refusal):
    from titan_ulysses.config.manager import ConfigError, load_config
    from titan_ulysses.preflight import validate

    with pytest.raises(ConfigError) as e:
        validate(load_config(argv), world_size=2)
    assert refusal in str(e.value)
    assert not dist.is_initialized()


def test_target_names_ours_or_hugging_faces_and_the_default_is_every_projection():
    from titan_ulysses.config.job_config import LoRA

    assert resolve_targets("w2, q_proj,wk") == ("q_proj", "k_proj", "down_proj")
    assert resolve_targets(LoRA().target_modules) == resolve_targets("wq,wk,wv,wo,w1,w2,w3")
    model = small_args()
    with torch.device("meta"):
        m = Transformer(model)
    apply_lora(m, LoRAOptions(rank=2, targets=resolve_targets("o_proj,up_proj")), torch.bfloat16)
    adapted = sorted(n for n, p in m.named_parameters() if p.requires_grad)
    assert adapted == [f"layers.{i}.{path}.{ab}" for i in range(2) for path in ("attention.wo", "feed_forward.w3")
                       for ab in ("lora_A", "lora_B")]
    assert {p.dtype for p in m.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in m.parameters() if p.requires_grad} == {torch.float32}


def _initial_load(folder):
    """LoRA on another run's weights (checkpoint.initial_load_path, e.g. after context extension)."""
    from titan_ulysses.distributed.lora import init_state

    pd = ParallelDims(sp=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    args = small_args()
    torch.manual_seed(3)
    base = Transformer(args)
    base.init_weights()

    def manager(model, name):
        opt = build_optimizer(model, "AdamW", LR, 0.1, 1e-8, (0.9, 0.999), "cpu")
        return CheckpointManager(folder=os.path.join(folder, name), model=model, optimizer=opt, lr_scheduler=opt,
                                 dataloader=opt, enable=True, interval=1)

    full_run = parallel_twin(base, args, pd, ParallelizeOptions(param_dtype=torch.float32))
    manager(full_run, "full").save(1)
    lora_run = parallel_twin(trained_like_reference(args), args, pd, ParallelizeOptions(param_dtype=torch.float32,
                                                                                        lora=LORA))
    init_lora(lora_run, seed=5)
    manager(lora_run, "lora").load_model_only(os.path.join(folder, "full", "step-1"))
    adapters = init_state(lora_run, seed=5)
    for name, p in lora_run.named_parameters():
        name = clean_name(name)
        expected = adapters[name] if name in adapters else base.state_dict()[name]
        assert torch.equal(full(p.detach()), expected), name
    # the other way round would drop the adapters: refused
    manager(lora_run, "lora").save(1)
    with pytest.raises(ValueError, match="holds LoRA adapters that this run.s \\[lora\\] settings would drop"):
        manager(full_run, "full").load_model_only(os.path.join(folder, "lora", "step-1"))


def test_lora_starts_from_a_base_checkpoint_and_a_lora_checkpoint_is_not_loaded_without_adapters(tmp_path):
    run_distributed(_initial_load, 2, str(tmp_path))


def test_chunked_loss_with_a_frozen_output_weight():
    """The chunked loss computes no [V, D] gradient for a frozen output weight (LoRA), and the hidden
    states' gradient is the unchunked loss's."""
    from titan_ulysses.ops.loss import cross_entropy_sum, linear_cross_entropy_sum

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 13, 32, generator=g, requires_grad=True)
    weight = torch.randn(300, 32, generator=g)  # frozen
    labels = torch.randint(0, 300, (2, 13), generator=g)
    labels[0, :5] = -100
    linear_cross_entropy_sum(hidden, weight, labels, chunk_size=4).backward()
    expected = hidden.detach().clone().requires_grad_()
    cross_entropy_sum(expected @ weight.t(), labels).backward()
    assert_close(hidden.grad, expected.grad, "hidden gradient")
    assert weight.grad is None


def test_init_lora_zeroes_every_b_so_the_logits_are_the_base_models_bit_for_bit():
    """peft's init: B exactly zero (A random), so a fresh adapter changes nothing at all."""
    args = small_args()
    torch.manual_seed(0)
    plain = Transformer(args)
    plain.init_weights()
    adapted = Transformer(args)
    adapted.load_state_dict(plain.state_dict())
    apply_lora(adapted, LORA, torch.float32)
    init_lora(adapted, seed=1)
    b = [p for n, p in adapted.named_parameters() if n.endswith("lora_B")]
    a = [p for n, p in adapted.named_parameters() if n.endswith("lora_A")]
    assert len(b) == len(a) == 7 * args.n_layers
    assert all(torch.count_nonzero(p) == 0 for p in b), "a lora_B is not exactly zero after init_lora"
    assert all(torch.count_nonzero(p) > 0 for p in a)
    tokens = torch.randint(0, args.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(adapted(tokens), plain(tokens))


@pytest.mark.parametrize("rank, alpha", [(4, 8.0), (2, 16.0), (8, 1.0)])
def test_the_adapter_update_is_alpha_over_rank_times_b_a(rank, alpha):
    """Against the formula itself, not the module's own ``lora_scaling``: y = x W^T + (alpha / rank) x A^T B^T."""
    linear = torch.nn.Linear(12, 10, bias=True)
    model = torch.nn.Module()
    model.attention = torch.nn.Module()
    model.attention.wq = linear
    base = torch.nn.Linear(12, 10, bias=True)
    base.load_state_dict(linear.state_dict())
    apply_lora(model, LoRAOptions(rank=rank, alpha=alpha, targets=("q_proj",)), torch.float32)
    g = torch.Generator().manual_seed(rank)
    a, b = torch.randn(rank, 12, generator=g), torch.randn(10, rank, generator=g)
    with torch.no_grad():
        linear.lora_A.copy_(a)
        linear.lora_B.copy_(b)
        x = torch.randn(3, 5, 12, generator=g)
        expected = base(x) + (alpha / rank) * (x @ a.t() @ b.t())
        torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)


def test_the_adapters_base_model_is_an_absolute_folder_or_the_name_given(tmp_path, monkeypatch):
    """peft reads ``base_model_name_or_path`` wherever the adapter is loaded: a relative folder would point elsewhere
    (issue 32 item 5). A local folder is recorded absolute; a Hub id or a flavor's name is kept as given."""
    import json

    from titan_ulysses.interop.peft_export import RECORD, write_lora_record

    (tmp_path / "models" / "base").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for given, recorded in (("models/base", str(tmp_path / "models" / "base")),
                            ("./models/base/", str(tmp_path / "models" / "base")),
                            ("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M"), ("debugmodel", "debugmodel")):
        write_lora_record(str(tmp_path), LoRAOptions(rank=2, alpha=4.0), given)
        assert json.loads((tmp_path / RECORD).read_text())["base_model_name_or_path"] == recorded
