"""Context parallelism (``cp``, all-gather of K/V) alone and beside Ulysses equals one process.

Each layout case checks this rank's logits (mapped back through the load-balanced order),
the loss, every parameter gradient and the parameters after AdamW steps (fp32, rtol 1e-5),
with S = 13 (every case pads) and GQA (8 q heads with 2 kv heads; 6 q heads with 1 kv head,
replicated for sp; 16 q heads with 4 kv heads split unevenly over sp 3).
Layouts: cp4, cp2 with packed documents (the dense-mask path) and full activation
checkpointing, cp2 x sp2, dp_shard2 x cp2 with full checkpointing, cp2 x tp2, cp2 x sp3, cp2 with
selective checkpointing, cp2 with the trainer's per-block torch.compile(fullgraph=True)
and selective checkpointing, and cp2 x sp2 with compile, selective checkpointing and packed
documents at once. The trainer's runs through torchrun are in
``test_context_parallel_trainer.py``.
"""

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import TorchDispatchMode

from dist_utils import assert_close, run_distributed
from model_harness import assert_params_match, build_pair, clean_name, full, small_args
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.preflight import validate
from titan_ulysses.data.sharding import check_seq_len, load_balanced_order, shard_batch
from titan_ulysses.distributed.context_parallel import cp_mask
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.utils import dist_sum
from titan_ulysses.step import global_token_count
from titan_ulysses.models.decoder.parallelize import ParallelizeOptions
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


def _compare(layout: dict, overrides: dict, packed: bool, options: dict):
    pd = ParallelDims(**layout, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    args = small_args(**overrides)
    ref, model = build_pair(args, pd, ParallelizeOptions(param_dtype=torch.float32, **options))
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
        if real.any():  # cp2 x sp3 pads 13 tokens to 24: a rank may hold padding only
            assert_close(out.detach()[:, real], ref_logits.detach()[rows][:, mb.index[real]], f"step {step} logits")
        grads = {clean_name(n): full(p.grad) for n, p in model.named_parameters()}
        assert grads.keys() == ref_params.keys()
        # after an AdamW step the two models' parameters differ by roundoff that Adam scales up
        # (g / (|g| + eps) for a near-zero g): measured up to 2e-5 of the largest gradient;
        # a wrong mask, order or reduction is 1e-2 or more
        tol = 1e-5 if step == 0 else 1e-4
        for name, g in grads.items():
            assert_close(g, ref_params[name].grad, f"step {step} grad {name}", rtol=tol, atol=tol)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()

    assert_params_match(model, ref_params, LR, STEPS)


CASES = {
    # id: (world size, layout, model overrides, packed documents, ParallelizeOptions)
    "cp4": (4, dict(cp=4), {}, False, {}),  # 8 chunks: ranks hold (0, 7), (1, 6), (2, 5), (3, 4)
    # the all-gather recomputed in backward
    "cp2-packed-documents-ac-full": (2, dict(cp=2), {}, True, dict(ac_mode="full")),
    # 6 heads, 1 kv head: an even split of 4 ranks per sequence; the kv head replicated for sp
    "cp2-sp2-6heads-kv-replicated": (4, dict(cp=2, sp=2), dict(dim=48, n_heads=6, n_kv_heads=1), False, {}),
    "dp_shard2-cp2-ac-full": (4, dict(dp_shard=2, cp=2), {}, False, dict(ac_mode="full")),
    "cp2-tp2": (4, dict(cp=2, tp=2), {}, False, {}),
    # uneven Ulysses inside cp: 16 heads over sp 3 (6/5/5 q heads straddling kv groups, kv heads
    # expanded before the cp all-gather)
    "cp2-sp3-16heads-uneven": (6, dict(cp=2, sp=3), dict(n_heads=16, n_kv_heads=4), False, {}),
    # the K/V all-gather and both chunks' attention kept, the lower-right causal mask recomputed
    "cp2-ac-selective": (2, dict(cp=2), {}, False, dict(ac_mode="selective")),
    # the trainer's per-block torch.compile(fullgraph=True): the all-gather, the load-balanced
    # key order and the causal mask traced; selective AC inside the compiled block
    "cp2-compile-ac-selective": (2, dict(cp=2), {}, False, dict(ac_mode="selective", compile=True)),
    # all of it at once: compiled blocks with the cp all-gather and both Ulysses all-to-alls,
    # packed documents (the dense document mask through the load-balanced order), selective AC
    "cp2-sp2-packed-compile-ac-selective": (4, dict(cp=2, sp=2), {}, True, dict(ac_mode="selective", compile=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cp_layout_matches_single_process(case):
    world, layout, overrides, packed, options = CASES[case]
    run_distributed(_compare, world, layout, overrides, packed, options)


class _CountOps(TorchDispatchMode):
    """Counts the functional collectives and the sdpa forward kernels that run under it."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if func.namespace == "_c10d_functional" or name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
            self.counts[name.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _selective_ac_keeps_the_gathered_kv():
    from torch.utils.checkpoint import checkpoint

    from titan_ulysses.distributed.activation_checkpoint import _selective_context
    from titan_ulysses.distributed.context_parallel import ContextParallelAttention
    from titan_ulysses.ops.attention import SDPAAttention

    pd = ParallelDims(cp=2, world_size=2)
    pd.build_mesh("cpu")
    attention = ContextParallelAttention(SDPAAttention(), pd.get_mesh("cp"))
    backward = {}
    for mode, context_fn in (("selective", _selective_context), ("full", None)):
        q, k, v = (torch.randn(1, 8, h, 8, requires_grad=True) for h in (4, 2, 2))  # [B, S/cp, H, D]
        out = checkpoint(attention, q, k, v, use_reentrant=False, **({"context_fn": context_fn} if context_fn else {}))
        with _CountOps() as ops:
            out.sum().backward()
        backward[mode] = ops.counts
    # selective: backward reduce-scatters the K/V gradients and neither gathers again nor reruns attention
    assert backward["selective"]["reduce_scatter_tensor"] == 1, backward
    assert backward["selective"]["all_gather_into_tensor"] == 0, backward
    assert backward["selective"]["_scaled_dot_product_flash_attention_for_cpu"] == 0, backward
    # full: the recompute gathers again and runs both chunks' attention again (the counter sees them)
    assert backward["full"]["all_gather_into_tensor"] == 1, backward
    assert backward["full"]["_scaled_dot_product_flash_attention_for_cpu"] == 2, backward


def test_selective_ac_keeps_the_gathered_kv_and_attention_outputs():
    run_distributed(_selective_ac_keeps_the_gathered_kv, 2)


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
    validate(load_config(base + ["--model.attn_backend", "flex"]), 8)  # every registered backend runs under cp
    pd = validate(load_config(base + ["--activation_checkpoint.mode", "selective", "--compile.enable", "true"]), 8)
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


def test_cp_refuses_a_local_attention_it_cannot_drive():
    from titan_ulysses.distributed.context_parallel import ContextParallelAttention

    class OneRankMesh:  # the check comes before any process group is touched
        ndim = 1

    class Plain(torch.nn.Module):  # neither causal_lower_right nor block_mask_for
        def forward(self, q, k, v, attention_mask=None):
            return q

    with pytest.raises(NotImplementedError, match="needs a local attention with causal_lower_right or block_mask_for, "
                                                  "not Plain; use model.attn_backend 'sdpa', 'flex' or 'flash_attn'"):
        ContextParallelAttention(Plain(), OneRankMesh())  # type: ignore[arg-type]


def test_estimator_and_comm_model_know_cp():
    import dataclasses

    from titan_ulysses.metrics.comm import context_parallel_bytes_per_step, ulysses_bytes_per_step
    from titan_ulysses.planning.estimate import estimate
    from titan_ulysses.planning.inputs import GIB, Layout, Switches
    from titan_ulysses.planning.recommend import recommend
    from titan_ulysses.models.flavors import get_flavor

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
    # selective AC keeps the all-gathered K/V (the whole sequence: cp x the local tokens) instead of the prefixes
    sel = dataclasses.replace(sw, ac_mode="selective")
    assert (estimate(big, Layout(sp=4, cp=2), sel, 131072).saved_activations
            - estimate(big, Layout(sp=8), sel, 131072).saved_activations) == pytest.approx(
        big.n_layers * 2 * 2 * 2 * 128 * 131072, rel=0.01)  # 2 bytes x 2 (k, v) x 2 kv heads x 128 x S
    # full AC keeps none of it: it comes back only in the recompute of one layer
    full = dataclasses.replace(sw, ac_mode="full")
    assert estimate(big, Layout(sp=4, cp=2), full, 131072).saved_activations == pytest.approx(
        estimate(big, Layout(sp=8), full, 131072).saved_activations)

    # Qwen2.5-7B's shape (28 heads, 4 kv heads): ulysses_degree 8 splits the heads unevenly, so with
    # sdpa a length that needs 8 ranks per sequence gets the even ulysses 4 x context_parallel 2
    qwen = get_flavor("8B", dim=3584, n_heads=28, n_kv_heads=4, ffn_hidden_dim=18944, vocab_size=152064)
    rec = recommend(qwen, Layout(dp_shard=8), sw, 3145728, 1, 8, 0.9 * 80 * GIB)
    assert rec is not None and rec[1][:2] == ["--parallelism.ulysses_degree 4",
                                              "--parallelism.context_parallel_degree 2"], rec[1]
    # where Ulysses alone is allowed it is chosen: the 8B (32 heads) at the same length
    rec = recommend(big, Layout(dp_shard=8), sw, 3145728, 1, 8, 0.9 * 80 * GIB)
    assert rec is not None and rec[1][0] == "--parallelism.ulysses_degree 8" and "context" not in " ".join(rec[1])


def test_recommend_proposes_cp_on_every_backend_that_runs_under_cp():
    """Every registered backend runs under cp (ops/attention/registry.py), so flex and flash_attn get
    the split sdpa gets, without a backend change; a backend the registry marks otherwise would be
    offered cp only after every split that keeps it, with ``--model.attn_backend sdpa``."""
    import dataclasses
    from unittest import mock

    from titan_ulysses.planning.estimate import estimate
    from titan_ulysses.planning.inputs import GIB, Layout, Switches
    from titan_ulysses.planning.recommend import recommend
    from titan_ulysses.models.flavors import get_flavor
    from titan_ulysses.ops.attention import registry

    # 12 heads, 4 kv heads, 12 GPUs: 3 ranks per sequence split the heads evenly only as 1 x cp 3,
    # and a budget that 3 ranks just meet
    args = get_flavor("debugmodel", dim=192, n_heads=12, n_kv_heads=4)
    lean = Switches(loss_chunk_size=8192, mlp_tile_size=8192, ac_mode="full_offload")
    budget = estimate(args, Layout(dp_shard=4, cp=3), lean, 49152).total
    sdpa = recommend(args, Layout(dp_shard=12), Switches(), 49152, 1, 12, budget)
    assert sdpa is not None and sdpa[1][:2] == ["--parallelism.ulysses_degree 1", "--parallelism.context_parallel_degree 3"]
    for backend in ("flex", "flash_attn"):
        other = recommend(args, Layout(dp_shard=12), Switches(), 49152, 1, 12, budget, attn_backend=backend)
        assert other is not None and other[1] == sdpa[1], (backend, other[1])
    # a backend without cp keeps itself: the even ulysses 4 (ulysses 3 straddles kv groups: more memory)
    no_cp = dataclasses.replace(registry.BACKENDS["flex"], cp=False)
    with mock.patch.dict(registry.BACKENDS, {"flex": no_cp}):
        assert estimate(args, Layout(dp_shard=4, sp=3), lean, 49152).total > budget
        flex = recommend(args, Layout(dp_shard=12), Switches(), 49152, 1, 12, budget, attn_backend="flex")
    assert flex is not None and flex[1][0] == "--parallelism.ulysses_degree 4", flex[1]
    assert not any("context_parallel" in f or "attn_backend" in f for f in flex[1]), flex[1]
