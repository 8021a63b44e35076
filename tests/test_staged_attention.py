"""Head-staged Ulysses (``distributed/staged_attention.py``) equals one process and plain Ulysses.

Model-level cases compare the loss and every parameter gradient with a single-process
reference (fp32, rtol 1e-5) on layouts that exercise each head split: kv heads split evenly,
kv heads replicated, uneven heads, cp, one process; with selective, full and offloaded AC.
The compile case traces a staged block with ``fullgraph=True`` against the plain Ulysses block.
The kernel-count case checks what ``ulysses_stage_keep_attention`` is for: kept, the stages run
the attention kernel as often as plain attention does and hold its outputs between forward and
backward exactly when plain attention does (never under full AC: no leak). The stages need of an
attention module only the contract it derives from (``ops/attention/contracts.HeadAttention``),
whatever its projections are called.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.multiprocessing.reductions import StorageWeakRef

from dist_utils import assert_close, run_distributed
from model_harness import assert_blocks_match, assert_step_matches, build_pair, make_batch, small_args
from titan_ulysses.distributed.activation_checkpoint import apply_ac
from titan_ulysses.distributed.compile import apply_compile
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.staged_attention import apply_head_stages, check_head_stages, stage_plans
from titan_ulysses.distributed.ulysses import apply_ulysses
from titan_ulysses.models.decoder.attention import apply_rope
from titan_ulysses.models.decoder.model import Transformer
from titan_ulysses.models.decoder.parallelize import ParallelizeOptions
from titan_ulysses.models.rope import rope_inv_freq
from titan_ulysses.ops.attention import build_attention
from titan_ulysses.ops.attention.contracts import HeadAttention, HeadProjections

SEQ_LEN = 13


def _staged_matches_single_process(layout, ac_mode, stages, overrides, keep):
    pd = ParallelDims(**layout, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    args = small_args(**overrides)
    options = ParallelizeOptions(ac_mode=ac_mode, param_dtype=torch.float32, ulysses_head_stages=stages,
                                 ulysses_stage_keep_attention=keep)
    ref, model = build_pair(args, pd, options)
    assert sum(type(m).__name__.startswith("HeadStaged") for m in model.modules()) == args.n_layers
    # trained-like weights: scale the attention projections so a head routed to the wrong
    # rank, stage or kv head moves the loss far above the tolerance
    with torch.no_grad():
        for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
            if ".attention.w" in name:
                p.mul_(6.0)
                q.copy_(p) if not hasattr(q, "full_tensor") else q.mul_(6.0)
    inputs, labels = make_batch(0, 4, SEQ_LEN, args.vocab_size)
    assert_step_matches(ref, model, pd, inputs, labels)


CASES = {
    # id: (world, layout, ac mode, stages, model overrides[, stage_keep_attention: True unless given])
    # 8 heads, 2 kv heads at sp=2: 4 q heads and one kv head per rank, two stages of 2 q heads sharing it
    "sp2-stages2": (2, dict(sp=2), "none", 2, {}),
    # kv heads replicated to 4 ranks, one q head per stage: each stage exchanges the kv head again
    "sp4-kv-replicated-stages2-selective": (4, dict(sp=4), "selective", 2, {}),
    # q heads 6/5/5 straddling kv groups, stages of 3/3, 3/2, 3/2: uneven exchanges and local kv expansion
    "sp3-16heads-kv4-uneven-stages2-full": (3, dict(sp=3), "full", 2, dict(n_heads=16, n_kv_heads=4)),
    # cp inside the stages' exchange (K/V all-gathered over cp per stage), FSDP over dp_shard
    "cp2-sp2-stages4-ac-full-offload": (4, dict(cp=2, sp=2), "full_offload", 4, dict(n_kv_heads=8)),
    # one process: the stages without any exchange, qkv biases and qk norms
    "one-process-stages4": (1, dict(), "none", 4, dict(qkv_bias=True, qk_norm=True)),
    # the stages recompute their attention kernel too (ulysses_stage_keep_attention = false)
    "sp2-stages2-full-no-keep": (2, dict(sp=2), "full", 2, {}, False),
    "sp4-kv-replicated-stages2-selective-no-keep": (4, dict(sp=4), "selective", 2, {}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_staged_matches_single_process(case):
    world, layout, ac_mode, stages, overrides, *keep = CASES[case]
    run_distributed(_staged_matches_single_process, world, layout, ac_mode, stages, overrides, *(keep or [True]))


def _compiled_staged_block_matches_plain(overrides, stages):
    pd = ParallelDims(sp=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    sp_mesh = pd.get_mesh("sp")
    torch.manual_seed(0)
    args = small_args(n_layers=1, **overrides)
    model = Transformer(args)
    model.init_weights()
    plain, staged = model.layers["0"], copy.deepcopy(model.layers["0"])
    apply_ulysses(plain, sp_mesh)
    apply_ulysses(staged, sp_mesh)
    apply_head_stages(staged, stages)
    compiled = torch.compile(staged, fullgraph=True)  # raises on any graph break

    assert_blocks_match(model, sp_mesh, plain, compiled, staged, "staged", input_scale=4)


def test_compiled_staged_block_matches_plain_ulysses():
    # uneven 5/4 q heads on 3 kv heads, 2 stages: uneven exchanges, concatenated weight slices and rank 0's
    # local kv expansion inside the graph (kv replication is covered eagerly above; one compile is ~20 s)
    run_distributed(_compiled_staged_block_matches_plain, 2, dict(dim=72, n_heads=9, n_kv_heads=3), 2)


def _compiled_layers_share_one_graph():
    pd = ParallelDims(sp=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    torch.manual_seed(0)
    model = Transformer(small_args(n_layers=2))
    model.init_weights()
    apply_ulysses(model, pd.get_mesh("sp"))  # checks slice lengths in the first layer only
    apply_head_stages(model, 2)  # kept kernel outputs (the default)
    apply_ac(model, "full")
    apply_compile(model)
    tokens = torch.randint(0, model.args.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    # every layer must reuse the first layer's graph: a per-layer guard (a module's identity, a flag
    # of the first layer) recompiles each of them, and 32 layers pass the recompile limit (fullgraph: a crash)
    with torch._dynamo.config.patch(error_on_recompile=True):
        model(tokens, positions=torch.arange(8)[None] + 8 * dist.get_rank()).sum().backward()


def test_compiled_staged_layers_share_one_graph():
    run_distributed(_compiled_layers_share_one_graph, 2)


def test_stage_plans_cover_each_rank_heads_once():
    for hq, hkv, sp, g in [(32, 8, 8, 4), (28, 4, 8, 3), (16, 4, 3, 2), (8, 2, 1, 8), (32, 4, 8, 2)]:
        plans = stage_plans(hq, hkv, sp, g)
        for r in range(sp):
            heads = [h for p in plans for h in range(*p.q[r])]
            assert heads == sorted(heads) and len(heads) == len(set(heads))
            for p in plans:
                assert {h // (hq // hkv) for h in range(*p.q[r])} == set(range(*p.kv[r]))
        assert sorted(h for p in plans for r in range(sp) for h in range(*p.q[r])) == list(range(hq))


def test_refusals_name_the_setting():
    check_head_stages(4, 32, 8, 8)
    with pytest.raises(ValueError, match=r"^parallelism.ulysses_head_stages 3 does not divide the 4 q heads per rank "
                                         r"\(32 heads over ulysses_degree 8\); use one of \[1, 2, 4\]$"):
        check_head_stages(3, 32, 8, 8)
    with pytest.raises(ValueError, match=r"^parallelism.ulysses_head_stages 4 is more than the 3 q heads"):
        check_head_stages(4, 28, 4, 8)
    with pytest.raises(ValueError, match=r"^parallelism.ulysses_head_stages must be an integer >= 1"):
        check_head_stages(0, 32, 8, 8)
    with pytest.raises(ValueError, match=r"^parallelism.ulysses_head_stages 2 does not combine with "
                                         r"tensor_parallel_degree 2"):
        check_head_stages(2, 32, 8, 2, tp=2)


class _CountAttention(TorchDispatchMode):
    """Heads the CPU attention kernel attends (summed over its calls) and a weak reference to each output."""

    def __init__(self):
        super().__init__()
        self.heads, self.outputs = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            self.heads += args[0].shape[1]  # q [B, H, S, Dh]
            self.outputs.append(StorageWeakRef(out[0].untyped_storage()))
        return out


@pytest.mark.parametrize("ac_mode", ["none", "selective", "full"])
def test_kept_stages_run_the_kernel_as_plain_attention_does(ac_mode):
    torch.manual_seed(0)
    args = small_args(n_layers=2)
    base = Transformer(args)
    base.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    x = base.tok_embeddings(tokens).detach() * 4  # [B, S, D]
    rope = base.rope(torch.arange(16))
    runs = {}
    for name, stages, keep in (("plain", 1, True), ("kept", 4, True), ("recomputed", 4, False)):
        model = copy.deepcopy(base)
        apply_head_stages(model, stages, keep)
        apply_ac(model, ac_mode)
        xi = x.clone().requires_grad_()
        with _CountAttention() as count:
            h = xi
            for layer in model.layers.values():
                h = layer(h, rope)
            forward = count.heads
            held = sum(not ref.expired() for ref in count.outputs)  # kernel outputs alive until backward
            h.square().sum().backward()
        runs[name] = (forward, count.heads - forward, bool(held), xi.grad)
        assert not any(getattr(m, "_stage_kept", None) for m in model.modules())  # every hand-over consumed
    plain, kept, recomputed = runs["plain"], runs["kept"], runs["recomputed"]
    assert kept[:3] == plain[:3], (kept[:3], plain[:3])  # heads attended in forward, in backward; outputs held
    assert recomputed[0] == plain[0] and recomputed[1] == plain[1] + plain[0]  # one more kernel run per stage
    assert plain[2] == (ac_mode != "full")
    for other in (kept, recomputed):
        assert_close(other[3], plain[3], "input grad", rtol=1e-4, atol=1e-5)


class _RenamedAttention(HeadAttention):
    """An attention module with projections of other names (and an output bias): only the contract
    (ops/attention/contracts.HeadAttention) in common with the decoder's."""

    def __init__(self, dim=32, heads=4, kv_heads=2, head_dim=8):
        super().__init__()
        self.head_dim, self.attention_kwargs = head_dim, {}
        self.q_proj = torch.nn.Linear(dim, heads * head_dim, bias=True)
        self.k_proj = torch.nn.Linear(dim, kv_heads * head_dim, bias=True)
        self.v_proj = torch.nn.Linear(dim, kv_heads * head_dim)
        self.dense = torch.nn.Linear(heads * head_dim, dim, bias=True)
        self.inner_attention = build_attention("sdpa")

    def projections(self):
        return HeadProjections(self.q_proj, self.k_proj, self.v_proj, self.dense)

    def prepare_qk(self, q, k, rope):
        return apply_rope(q, *rope), apply_rope(k, *rope)

    def forward(self, x, rope, attention_mask=None):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.prepare_qk(q, k, rope)
        return self.dense(self.inner_attention(q, k, v, attention_mask).reshape(b, s, -1))


def test_stages_use_the_declared_attention_interface_only():
    torch.manual_seed(0)
    plain = _RenamedAttention()
    assert isinstance(plain, HeadAttention)
    staged = copy.deepcopy(plain)
    assert apply_head_stages(staged, 2) == 1
    x = torch.randn(2, 11, 32)
    angles = torch.arange(11)[None, :, None].float() * rope_inv_freq(8, 10000.0, None)  # [1, S, Dh/2]
    rope = (angles.cos()[:, :, None], angles.sin()[:, :, None])
    outs = [m(x, rope) for m in (plain, staged)]
    assert_close(outs[1], outs[0], "staged output", rtol=1e-5, atol=1e-6)
    for out in outs:
        out.square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), staged.parameters()):
        assert_close(q.grad, p.grad, name, rtol=1e-5, atol=1e-6)
