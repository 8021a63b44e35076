"""The fused linear cross-entropy (``ops/loss/fused.py``, issue 47): loss and both gradients against an fp64
reference for every case it covers, no fp32 x fp32 ``[V, D]`` GEMM with bf16 inputs (the CUDA path's op
sequence on meta tensors), no recompute of the logits in backward, and Gemma 2's softcap in bounded memory."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from titan_ulysses.ops.loss import IGNORE_INDEX, cross_entropy_sum, linear_cross_entropy_sum, softcapped

N, D, V = 37, 16, 53  # no two equal: a matmul's operands say which projection it is
CHUNK = 8  # 5 chunks; the first is all ignored (below)
CASES = {
    "plain": {},
    "ignored": {"ignored": True},  # rows 0..9 ignored: a whole chunk and part of the next
    "softcap": {"softcap": 3.0, "ignored": True},
    "frozen_weight": {"frozen": True},
    "tied": {"tied": True, "ignored": True},
}


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5
    tokens = torch.randint(0, V, (N,), generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    return x, w, tokens, labels


def _loss(fn, x, w, tokens, labels, dtype, case):
    """(loss, dx, dw) of ``fn`` on leaf copies in ``dtype``; with ``tied`` the weight is also an embedding."""
    x, w = x.to(dtype).clone().requires_grad_(), w.to(dtype).clone().requires_grad_(not case.get("frozen"))
    hidden = x + F.embedding(tokens, w) if case.get("tied") else x * 1.0  # [N, D]
    if case.get("ignored"):
        labels = labels.clone()
        labels[:10] = IGNORE_INDEX
    loss = fn(hidden, w, labels, case.get("softcap"))
    (loss * 0.37).backward()  # a normaliser: backward scales
    return loss, x.grad, w.grad


def _reference(hidden, w, labels, softcap):
    return cross_entropy_sum(softcapped(hidden @ w.t(), softcap)[None], labels[None])


def _fused(hidden, w, labels, softcap):
    return linear_cross_entropy_sum(hidden, w, labels, backend="fused", chunk_size=CHUNK, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_loss_and_gradients_match_the_fp64_reference(case, dtype):
    inputs = _inputs()
    ref, ref_dx, ref_dw = _loss(_reference, *inputs, torch.float64, CASES[case])
    loss, dx, dw = _loss(_fused, *inputs, dtype, CASES[case])
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
    for got, want in ((dx, ref_dx), (dw, ref_dw)):
        if want is None:
            assert got is None
            continue
        assert got.dtype == dtype
        assert (got.double() - want).norm() <= tol * want.norm(), (case, dtype)


def test_fused_loss_of_all_ignored_labels_is_zero_with_zero_gradients():
    x, w, _, labels = _inputs()
    x, w = x.requires_grad_(), w.requires_grad_()
    loss = linear_cross_entropy_sum(x, w, torch.full_like(labels, IGNORE_INDEX), chunk_size=CHUNK)
    loss.backward()
    assert loss.item() == 0.0 and x.grad.abs().max().item() == 0.0 and w.grad.abs().max().item() == 0.0


class _Matmuls(TorchDispatchMode):
    """Every mm / addmm: (its operands' shapes and dtypes, the phase it ran in)."""

    def __init__(self):
        super().__init__()
        self.calls, self.phase = [], "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            operands = args[1:3] if func.overloadpacket != torch.ops.aten.mm else args[:2]
            self.calls.append(([(tuple(t.shape), t.dtype) for t in operands], self.phase))
        return func(*args, **kwargs)


def test_no_fp32_gemm_of_vocab_size_with_bf16_inputs_on_the_cuda_path():
    """The CUDA path's op sequence on meta tensors (``mm(..., out_dtype=fp32)`` exists for CUDA and meta,
    not CPU): every matmul touching the vocabulary takes bf16 operands; the old chunked backward's
    ``grad_weight.addmm_(fp32, fp32)`` (8.6 TFLOP on CUDA cores at 16K x 128256 x 2048) fails this."""
    n, d, v = 96, 64, 1000
    with torch.device("meta"):
        hidden = torch.empty(n, d, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.empty(v, d, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.zeros(n, dtype=torch.long)
    with _Matmuls() as mode:
        loss = linear_cross_entropy_sum(hidden, weight, labels, chunk_size=32)
        mode.phase = "backward"
        loss.backward()
    vocab = [(ops, phase) for ops, phase in mode.calls if any(v in shape for shape, _ in ops)]
    assert not [c for c in vocab if any(dt != torch.bfloat16 for _, dt in c[0])], vocab
    assert len(vocab) == 3 * 3, vocab  # logits, dH, dW per chunk
    assert weight.grad.dtype == torch.bfloat16 and weight.grad.shape == (v, d)


def test_the_output_projection_runs_three_matmuls_per_chunk_all_in_forward():
    """One training step of a small model: the logits are computed once per chunk (no recompute in
    backward); the gradients' matmuls run in forward, and backward has no matmul of vocabulary size."""
    from model_harness import small_args
    from titan_ulysses.models.compute import ComputeOptions
    from titan_ulysses.models.decoder.model import Transformer

    torch.manual_seed(0)
    args = small_args(tie_embeddings=True)
    model = Transformer(args, ComputeOptions(loss_chunk_size=8))
    tokens = torch.randint(0, args.vocab_size, (2, 13))
    with _Matmuls() as mode:
        loss = model(tokens, labels=tokens)
        mode.phase = "backward"
        loss.backward()
    counts = {p: sum(1 for ops, phase in mode.calls if phase == p and any(args.vocab_size in s for s, _ in ops))
              for p in ("forward", "backward")}
    assert counts == {"forward": 3 * 4, "backward": 0}, counts  # 26 tokens in chunks of 8: 4 chunks


def test_no_grad_does_no_gradient_work():
    x, w, _, labels = _inputs()
    x, w = x.requires_grad_(), w.requires_grad_()
    with torch.no_grad(), _Matmuls() as mode:
        loss = linear_cross_entropy_sum(x, w, labels, chunk_size=CHUNK)
    assert loss.grad_fn is None and len(mode.calls) == 5  # the logits of each chunk, nothing else
    torch.testing.assert_close(loss, _reference(x.detach(), w.detach(), labels, None))


def _gemma2(vocab: int):
    from titan_ulysses.interop.hf_config import args_from_hf_config

    cfg = {"model_type": "gemma2", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": vocab,
           "final_logit_softcapping": 30.0, "sliding_window": 512, "max_position_embeddings": 65536,
           "attn_logit_softcapping": None}  # (the attention's softcap: explicit scores, many ops; not this test's)
    return args_from_hf_config(cfg)


def test_gemma2_softcap_trains_in_less_memory_than_its_logits():
    """Gemma 2 (final logit softcap 30) at 16K tokens x vocab 32K: materialised fp32 logits alone are
    2 GiB; the step's loss phases, traced under fake tensors, peak below that budget (the old head
    materialised them whatever loss_chunk_size said: 6.2 GiB in forward, 7.2 in backward)."""
    from titan_ulysses.planning.inputs import Layout, Switches
    from titan_ulysses.planning.track import track_step

    args, seq = _gemma2(32768), 16384
    assert args.final_softcap == 30.0
    logits = seq * args.vocab_size * 4
    step = track_step(args, Layout(), Switches(ac_mode="full", act_bytes=2), seq, extrapolate=False)
    loss = max(step.phases["loss forward"].peak, step.phases["loss backward"].peak)
    assert loss < logits, (loss / 2**30, logits / 2**30)


def test_the_fp32_pass_compiles_whole_and_equals_eager():
    """The function CUDA compiles (``fused._pass``) traces as one graph (no break) and computes what it does
    eagerly; ``aot_eager`` checks the trace on CPU without a C++ build."""
    from titan_ulysses.ops.loss.fused import loss_and_grad

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(12, V, generator=g, dtype=torch.bfloat16)
    labels = torch.randint(0, V, (12,), generator=g)
    labels[:5] = IGNORE_INDEX
    compiled = torch.compile(loss_and_grad, fullgraph=True, backend="aot_eager")
    for softcap in (None, 3.0):
        want, got = loss_and_grad(logits, labels, IGNORE_INDEX, softcap, torch.bfloat16), \
            compiled(logits, labels, IGNORE_INDEX, softcap, torch.bfloat16)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


def test_a_backend_that_cannot_run_is_refused_in_one_line(monkeypatch):
    """Before any process group (``preflight.validate``): no CUDA, the package missing, no softcap."""
    from titan_ulysses.config.manager import ConfigError, load_config
    from titan_ulysses.ops.loss.registry import loss_backend_problem
    from titan_ulysses.preflight import validate

    if not torch.cuda.is_available():
        config = load_config(["--config", "train_configs/debug_model.toml", "--model.loss_backend", "liger"])
        with pytest.raises(ConfigError, match=r"^model.loss_backend 'liger' needs a CUDA GPU and none is visible; "
                                              r"use one of \['fused', 'chunked', 'materialized'\]$"):
            validate(config, 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "cut_cross_entropy" else object())
    assert loss_backend_problem("cce") == ("model.loss_backend 'cce' needs the cut_cross_entropy package: "
                                           "pip install 'titan-ulysses[cce]' (or model.loss_backend fused)")
    assert loss_backend_problem("chunked", 30.0).startswith("model.loss_backend 'chunked' has no final logit softcap")
    assert loss_backend_problem("fused", 30.0) == "" and loss_backend_problem("materialized") == ""


def test_a_frozen_output_weight_gets_no_weight_gradient_work():
    """LoRA's frozen output weight: per chunk the logits and dH only, no ``[V, D]`` gradient made."""
    x, w, _, labels = _inputs()
    x = x.requires_grad_()
    with _Matmuls() as mode:
        linear_cross_entropy_sum(x, w, labels, chunk_size=CHUNK).backward()
    # logits [r, D] x [D, V] and dH [r, V] x [V, D] per chunk; dW's [V, r] x [r, D] never
    assert len(mode.calls) == 2 * 5, mode.calls
    assert not [ops for ops, _ in mode.calls if ops[0][0][0] == V], mode.calls
