"""Windows, softcapping and packed documents on every backend and layout, against brute force.

The reference is attention written out in float64 from the definition (causal, ``i - W < j``,
same document, ``softcap * tanh(s / softcap)``). Checked: each local backend (sdpa both through
its dense mask and per document; flex forward only: no CPU backward in PyTorch 2.13), and
Ulysses x context parallelism (sp2, cp2, cp2 x sp2) with outputs and the gradients of q, k, v
at the global positions of the load-balanced chunks. Scores are scaled up (q and k of norm
~4) so that a key leaking through a window or document boundary moves outputs far above
the tolerance.
"""

import math

import pytest
import torch
import torch.distributed as dist

from dist_utils import assert_close, run_distributed
from titan_ulysses.data.sharding import padded_length, rank_token_index
from titan_ulysses.distributed.context_parallel import ContextParallelAttention
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.ulysses import UlyssesAttention
from titan_ulysses.ops.attention import build_attention, build_attention_mask
from titan_ulysses.ops.attention import sdpa as sdpa_module


def reference(q, k, v, docs, window=0, softcap=0.0, scale=None):
    """Attention from its definition in float64: ``[B, S, Hq, D]`` -> ``[B, S, Hq, D]``."""
    b, s, h, d = q.shape
    rep = h // k.shape[2]
    k, v = (t.double().repeat_interleave(rep, 2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) * (d ** -0.5 if scale is None else scale)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(s)
    ok = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < window) if window else True)
    ok = ok[None] & (docs[:, :, None] == docs[:, None, :]) if docs is not None else ok[None]
    scores = scores.masked_fill(~ok[:, None], -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def _inputs(s, hq=4, hkv=2, d=8, seed=0, docs=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, s, hq, d, generator=g) * 2
    k = torch.randn(2, s, hkv, d, generator=g) * 2
    v = torch.randn(2, s, hkv, d, generator=g)
    doc = None
    if docs:
        starts = torch.rand(2, s, generator=g) < 6 / s
        doc = starts.long().cumsum(1)  # documents of random lengths, two rows that differ
    return q, k, v, doc


CASES = [(0, 0.0), (5, 0.0), (0, 2.5), (7, 2.5)]  # (window, softcap)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("window,softcap", CASES)
def test_local_backends_match_the_definition(backend, window, softcap, monkeypatch):
    monkeypatch.setattr(sdpa_module, "BLOCK", 16)  # several query blocks per document and window
    q, k, v, doc = _inputs(150)
    backward = backend == "sdpa"
    for docs in (None, doc):
        for dense in (True, False):
            leaves = [t.clone().requires_grad_(backward) for t in (q, k, v)]
            mask = build_attention_mask(backend, docs)
            if mask is not None and not dense:
                mask.dense = None  # sdpa's per-document path, as above DENSE_MASK_MAX_ELEMENTS
            out = build_attention(backend)(*leaves, mask, scale=0.3, window=window, softcap=softcap)
            ref_leaves = [t.double().requires_grad_(backward) for t in (q, k, v)]
            ref = reference(*ref_leaves, docs, window, softcap, scale=0.3)
            what = f"{backend} docs={docs is not None} dense={dense}"
            assert_close(out.double(), ref, f"{what} output", rtol=1e-5, atol=1e-5)
            if backward:
                grad = torch.randn_like(ref)
                out.backward(grad.float())
                ref.backward(grad)
                for name, a, b in zip("qkv", leaves, ref_leaves):
                    assert_close(a.grad.double(), b.grad, f"{what} d{name}", rtol=1e-5, atol=1e-5)


def _layout_matches(layout, backend, window, softcap, dense):
    pd = ParallelDims(**layout, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    sp, cp = pd.get_mesh("sp"), pd.get_mesh("cp")
    sp_rank, cp_rank = sp.get_local_rank(), cp.get_local_rank()
    sdpa_module.BLOCK = 8
    s = 45  # padded to 48 by 2 x cp x sp
    q, k, v, docs = _inputs(s, hq=4, hkv=2)
    s_pad = padded_length(s, sp.size(), cp.size())
    pad = s_pad - s
    full_docs = torch.nn.functional.pad(docs, (0, pad), value=-1)
    padded = [torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v)]
    index = rank_token_index(s_pad, sp_rank, sp.size(), cp_rank, cp.size())  # my tokens' global indices
    backward = backend == "sdpa"
    leaves = [t[:, index].clone().requires_grad_(backward) for t in padded]
    attn = UlyssesAttention(ContextParallelAttention(build_attention(backend), cp), sp)
    for with_docs in (False, True):
        mask = build_attention_mask(backend, full_docs if with_docs else None)
        if mask is not None and not dense:
            mask.dense = None
        out = attn(*leaves, mask, scale=0.4, window=window, softcap=softcap)  # [B, S/(cp sp), Hq, D]
        ref_leaves = [t.double().requires_grad_(backward) for t in padded]
        ref = reference(*ref_leaves, full_docs if with_docs else None, window, softcap, scale=0.4)
        real = index < s
        what = f"{layout} {backend} docs={with_docs} dense={dense}"
        assert_close(out.double()[:, real], ref[:, index[real]], f"{what} output", rtol=1e-5, atol=1e-5)
        if not backward:
            continue
        grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        grad[:, s:] = 0  # padding feeds no loss
        out.backward(grad[:, index].float())
        ref.backward(grad)
        for name, a, b in zip("qkv", leaves, ref_leaves):
            assert_close(a.grad.double()[:, real], b.grad[:, index[real]], f"{what} d{name}", rtol=1e-5, atol=1e-5)
            a.grad = None


LAYOUTS = {"sp2": (2, dict(sp=2)), "cp2": (2, dict(cp=2)), "cp2-sp2": (4, dict(cp=2, sp=2))}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("window,softcap,dense", [(0, 0.0, False), (5, 0.0, False), (7, 2.5, False), (5, 2.5, True)],
                         ids=["causal-per-document", "window-per-document", "window-softcap-per-document",
                              "window-softcap-dense"])
def test_sdpa_layouts_match_the_definition(layout, window, softcap, dense):
    world, degrees = LAYOUTS[layout]
    run_distributed(_layout_matches, world, degrees, "sdpa", window, softcap, dense)


@pytest.mark.parametrize("layout", ["cp2", "cp2-sp2"])
def test_flex_under_cp_matches_the_definition_forward(layout):
    # FlexAttention has no CPU backward; its BlockMask by the chunks' global indices is checked here
    world, degrees = LAYOUTS[layout]
    run_distributed(_layout_matches, world, degrees, "flex", 5, 2.5, False)


LONG = 33024  # B x S x S > 2**30: the length where sdpa's dense document mask used to be refused


def _long_packed(layout):
    from model_harness import build_pair, clean_name, full, small_args
    from titan_ulysses.data.sharding import shard_batch
    from titan_ulysses.distributed.utils import dist_sum
    from titan_ulysses.step import global_token_count
    from titan_ulysses.models.decoder.parallelize import ParallelizeOptions
    from titan_ulysses.ops.loss import IGNORE_INDEX, cross_entropy_sum

    pd = ParallelDims(**layout, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    args = small_args(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden_dim=32)
    ref, model = build_pair(args, pd, ParallelizeOptions(param_dtype=torch.float32))
    with torch.no_grad():  # sharper attention than init's: a key leaking across documents shows
        for m in (ref, model):
            for name, p in m.named_parameters():
                if any(w in name for w in ("wq", "wk", "wv", "wo")):
                    p.mul_(4)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, args.vocab_size, (1, LONG + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    starts = torch.rand(1, LONG, generator=g) < 1 / 2000
    starts[:, 0] = True
    docs = starts.long().cumsum(1) - 1  # ~16 documents
    index = torch.arange(LONG)[None]
    positions = index - torch.where(starts, index, torch.zeros_like(index)).cummax(1).values
    labels[:, 1:][starts[:, 1:]] = IGNORE_INDEX  # no label across a boundary
    n = (labels != IGNORE_INDEX).sum()
    first = dist.get_rank() == 0  # the one-process reference, on one rank (2 cores run all four)
    if first:
        mask = build_attention_mask("sdpa", docs)
        assert mask.dense is None  # per document: no [S, S] tensor at this length
        logits = ref(inputs, positions=positions, attention_mask=mask)  # [1, S, V]
        ref_loss = cross_entropy_sum(logits, labels) / n
        ref_loss.backward()
        with torch.no_grad():  # every document on its own, positions from 0: no mask at all
            alone = torch.cat([ref(inputs[:, docs[0] == d]) for d in docs.unique()], dim=1)
        assert_close(alone, logits.detach(), "packed logits vs each document alone")

    sp, cp = pd.get_mesh("sp"), pd.get_mesh("cp")
    mb = shard_batch(inputs, labels, sp.get_local_rank(), sp.size(), positions=positions, document_ids=docs,
                     cp_rank=cp.get_local_rank(), cp=cp.size())
    n_global = global_token_count([mb.labels], pd.get_mesh("loss"))
    loss = model(mb.tokens, positions=mb.positions, attention_mask=build_attention_mask("sdpa", mb.document_ids),
                 labels=mb.labels) / n_global
    loss.backward()
    total = dist_sum(loss.detach(), pd.get_mesh("loss")).float()
    grads = {clean_name(name): full(p.grad) for name, p in model.named_parameters()}  # collectives: every rank
    if first:
        assert_close(total, ref_loss.detach(), "loss")
        for name, p in ref.named_parameters():
            assert_close(grads[name], p.grad, f"grad {name}", rtol=1e-4, atol=1e-5)


def test_packed_documents_at_33k_tokens_without_a_dense_mask_match_one_process_cp2_sp2():
    run_distributed(_long_packed, 4, dict(cp=2, sp=2))


def _dense_blocks(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """A BlockMask's (num blocks, indices) ``[B, H, nQ]``, ``[B, H, nQ, nK]`` -> bool ``[B, H, nQ, nK]``."""
    n_k = idx.shape[-1]
    valid = torch.arange(n_k) < num[..., None]
    out = torch.zeros(*idx.shape[:-1], n_k + 1, dtype=torch.bool)
    out.scatter_(-1, torch.where(valid, idx.long(), n_k), True)
    return out[..., :n_k]


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("window", [0, 20, 45])
def test_flex_block_mask_blocks_match_the_exact_mask(cp, window, monkeypatch):
    """CPU flex runs eagerly and applies mask_mod everywhere, so the block structure (which the
    fused GPU kernel trusts: skipped blocks, and full blocks without mask_mod) is checked here:
    full blocks are exactly the all-visible ones, and every block with a visible pair is listed."""
    from titan_ulysses.data.sharding import load_balanced_order
    from titan_ulysses.ops.attention import flex

    monkeypatch.setattr(flex, "FLEX_BLOCK", 8)
    s = 100  # the last block runs past the end
    _, _, _, docs = _inputs(s)
    order = load_balanced_order(s - s % (2 * cp), cp) if cp > 1 else torch.arange(s)
    k_index = order
    q_index = order.view(cp, -1)[cp - 1]  # the last cp rank's head and tail chunks
    bm = flex.block_mask(docs, q_index, k_index, window)
    exact = (q_index[:, None] >= k_index[None]) & ((q_index[:, None] - k_index[None] < window) if window else True)
    exact = exact[None] & (docs[:, q_index][:, :, None] == docs[:, k_index][:, None, :])  # [B, Lq, Lk]
    lq, lk = len(q_index), len(k_index)
    nq, nk = -(-lq // 8), -(-lk // 8)
    padded = torch.zeros(2, nq * 8, nk * 8, dtype=torch.int)
    padded[:, :lq, :lk] = exact.int()
    counts = padded.view(2, nq, 8, nk, 8).sum((2, 4))  # visible pairs per block
    sizes = torch.zeros(nq * 8, nk * 8, dtype=torch.int)
    sizes[:lq, :lk] = 1
    sizes = sizes.view(nq, 8, nk, 8).sum((1, 3))
    full = _dense_blocks(bm.full_kv_num_blocks, bm.full_kv_indices)[:, 0]
    partial = _dense_blocks(bm.kv_num_blocks, bm.kv_indices)[:, 0]
    assert not (full & partial).any()
    assert torch.equal(full, (counts == 64) & (sizes == 64))  # every full-size all-visible block, nothing else
    assert torch.equal((full | partial) & (counts > 0), counts > 0)  # no visible pair is skipped
    assert full.any() and (counts == 0).any()  # the case has blocks of both kinds


@pytest.mark.parametrize("host_spans", [False, True])
def test_sdpa_per_document_op_compiles_once_and_differentiates(host_spans):
    """The per-document path is one custom op: a compiled block (fullgraph) does not retrace when the
    documents change, and its gradients (recomputed inside the backward op) equal eager ones; so with the
    documents' spans read on the host (the trainer's masks: ``SPBatch.spans``), however many there are."""
    import torch._dynamo

    from titan_ulysses.ops.attention.masks import row_spans

    torch._dynamo.reset()
    module = build_attention("sdpa")
    calls = {"n": 0}

    def count(gm, example_inputs):
        calls["n"] += 1
        return gm.forward

    compiled = torch.compile(lambda q, k, v, m: module(q, k, v, m, window=9), fullgraph=True, backend=count)
    for seed in (0, 1):
        q, k, v, docs = _inputs(96, seed=seed)
        mask = build_attention_mask("sdpa", docs, row_spans(docs) if host_spans else None)
        mask.dense = None  # the per-document op, as above DENSE_MASK_MAX_ELEMENTS
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = compiled(*leaves, mask)
        out.backward(torch.ones_like(out))
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref = reference(*ref_leaves, docs, 9)
        ref.backward(torch.ones_like(ref))
        assert_close(out.double(), ref, f"seed {seed} output")
        for name, a, b in zip("qkv", leaves, ref_leaves):
            assert_close(a.grad.double(), b.grad, f"seed {seed} d{name}")
    assert calls["n"] == 1  # new documents, same graph


def test_packed_long_windows_on_sdpa_validate_where_they_were_refused():
    """65536 packed tokens on sdpa needed a 4 GiB dense mask and were refused; now they validate, and
    what a backend cannot do is still refused in one line naming the alternatives."""
    from titan_ulysses.config.manager import ConfigError, load_config
    from titan_ulysses.preflight import validate
    from titan_ulysses.ops.attention import check_attention_settings

    base = ["--config", "train_configs/debug_model.toml", "--training.dataset", "sft", "--training.dataset_path",
            "docs/examples/sft_train.jsonl", "--training.seq_len", "65536"]
    validate(load_config(base), 2)
    with pytest.raises(ConfigError, match=r"^model.attn_backend 'flash_attn' cannot train on CPU \(flash-attn is "
                                          r"CUDA-only\); use one of \['sdpa'\] on CPU$"):
        try:
            check_attention_settings("flash_attn", "auto", 1, "cpu")
        except ValueError as e:
            raise ConfigError(str(e)) from e
    with pytest.raises(ValueError, match=r"model.attn_backend 'xformers' is not one of \['sdpa', 'flex', 'flash_attn'\]"):
        check_attention_settings("xformers", "auto", 1)


def test_flex_block_mask_traces_in_a_compiled_block():
    """The trainer compiles each block with fullgraph=True: flex's BlockMask (per window, from the
    step's document ids) must be built inside the graph without a data-dependent break."""
    module = build_attention("flex")
    compiled = torch.compile(lambda q, k, v, m: module(q, k, v, m, window=9, softcap=2.0), fullgraph=True,
                             backend="eager")
    q, k, v, docs = _inputs(150)
    for d in (None, docs):
        with torch.no_grad():  # no CPU backward
            out = compiled(q, k, v, build_attention_mask("flex", d))
        assert_close(out.double(), reference(q, k, v, d, 9, 2.0), f"docs={d is not None}")


def test_sdpa_sinks_match_transformers_eager_gpt_oss_attention():
    """gpt-oss's sinks on the sdpa backend (explicit scores, in query blocks; with a window) against
    transformers' own eager attention: output and the gradients of q, k, v and the sinks."""
    pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from titan_ulysses.ops.attention import build_attention

    g = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d = 2, 37, 4, 2, 8
    q, k, v = (torch.randn(b, s, h, d, generator=g) * 2 for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=g) * 2
    for window in (0, 9):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        ours = build_attention("sdpa")(*leaves[:3], None, window=window, sinks=leaves[3])
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        module = torch.nn.Module()
        module.sinks, module.num_key_value_groups, module.training = ref_leaves[3], hq // hkv, False
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        visible = (j <= i) & ((i - j < window) if window else True)
        mask = torch.zeros(s, s).masked_fill(~visible, float("-inf"))[None, None].expand(b, 1, s, s)
        ref, _ = eager_attention_forward(module, *(t.transpose(1, 2) for t in ref_leaves[:3]), mask,
                                         scaling=d ** -0.5, dropout=0.0)  # [B, S, H, D]
        assert_close(ours, ref, f"output, window {window}")
        grad = torch.randn(ours.shape, generator=g)
        ours.backward(grad), ref.backward(grad)
        for a, r, name in zip(leaves, ref_leaves, ("q", "k", "v", "sinks")):
            assert_close(a.grad, r.grad, f"d{name}, window {window}")
