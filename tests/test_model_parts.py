"""Single-process checks of the model's pieces, the LR schedule and the FLOP count."""

import math

import pytest
import torch

from titan_ulysses.metrics.flops import flops_per_token
from titan_ulysses.models.decoder.args import RopeScaling
from titan_ulysses.models.decoder.attention import apply_rope
from titan_ulysses.models.decoder.model import Transformer
from titan_ulysses.models.flavors import FLAVORS, get_flavor
from titan_ulysses.models.registry import num_params
from titan_ulysses.models.rope import rope_inv_freq
from titan_ulysses.ops.attention import cu_seqlens_from_document_ids
from titan_ulysses.optim import wsd_factor


def test_llama31_rope_scaling_keeps_high_and_divides_low_frequencies():
    plain = rope_inv_freq(128, 500000.0, None)
    scaled = rope_inv_freq(128, 500000.0, RopeScaling(factor=8.0))
    wavelen = 2 * math.pi / plain
    high = wavelen < 8192 / 4.0
    low = wavelen > 8192 / 1.0
    assert high.any() and low.any()
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8.0)
    mid = ~(high | low)
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8.0)).all()


def test_rope_is_relative():
    """q.k after RoPE depends only on the distance of positions: global offsets are consistent."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    inv = rope_inv_freq(16, 10000.0, None)

    def dot(pq, pk):
        cq, sq = torch.cos(pq * inv)[None, None, None], torch.sin(pq * inv)[None, None, None]
        ck, sk = torch.cos(pk * inv)[None, None, None], torch.sin(pk * inv)[None, None, None]
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    torch.testing.assert_close(dot(5.0, 2.0), dot(105.0, 102.0), rtol=1e-4, atol=1e-5)


def test_positions_drive_rope():
    torch.manual_seed(0)
    model = Transformer(get_flavor("debugmodel", n_layers=1))
    model.init_weights()
    tokens = torch.randint(0, 264, (1, 8))
    default = model(tokens)
    stretched = model(tokens, positions=torch.arange(8) * 2)  # a uniform shift would change nothing
    torch.testing.assert_close(model(tokens, positions=torch.arange(8)), default)
    assert (default - stretched).abs().max() > 1e-3
    torch.testing.assert_close(model(tokens, positions=torch.arange(8) + 3), default, rtol=1e-4, atol=1e-4)


def test_flavor_sizes():
    assert round(num_params(get_flavor("8B")) / 1e9, 2) == 8.03
    assert round(num_params(get_flavor("70B")) / 1e9, 1) == 70.6
    assert round(num_params(get_flavor("1B")) / 1e9, 2) == 1.24
    assert get_flavor("debugmodel_gqa1").n_kv_heads == 1
    assert set(FLAVORS) >= {"debugmodel", "debugmodel_gqa1", "1B", "3B", "8B", "70B"}


def test_flops_count_attention_once_for_causal():
    args = get_flavor("8B")
    dense = flops_per_token(args, 0)
    assert dense == pytest.approx(6 * (num_params(args) - args.vocab_size * args.dim))
    # attention adds 6 * L * H * Dh * S (12 * L * H * Dh * S halved by causality)
    assert flops_per_token(args, 8192) - dense == pytest.approx(6 * 32 * 32 * 128 * 8192)


def test_wsd_schedule():
    f = lambda s: wsd_factor(s, total_steps=100, warmup_steps=10, decay_ratio=0.2, decay_type="linear", min_lr_factor=0.1)
    assert f(0) == pytest.approx(1 / 11)
    assert f(9) == pytest.approx(10 / 11)
    assert f(10) == f(79) == 1.0
    assert f(80) == pytest.approx(1.0)
    assert f(90) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(100) == pytest.approx(0.1)
    cos = wsd_factor(90, 100, 10, 0.2, "cosine", 0.0)
    assert cos == pytest.approx(0.5)
    assert wsd_factor(50, 100, 10, 0.0, "linear", 0.0) == 1.0


def test_cu_seqlens_never_spans_rows():
    doc = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 2, 2]])
    cu, longest = cu_seqlens_from_document_ids(doc)
    assert cu.tolist() == [0, 2, 5, 8, 10] and cu.dtype == torch.int32
    assert longest == 3


@pytest.mark.parametrize("dtype,chunk", [(torch.float32, 4096), (torch.bfloat16, 4096), (torch.float32, 3)],
                         ids=["fp32", "bf16", "fp32-chunks-of-3-tokens"])
def test_rms_norm_equals_the_fp32_reference_and_keeps_only_its_input(dtype, chunk, monkeypatch):
    from torch.autograd.graph import saved_tensors_hooks

    from titan_ulysses.ops import norm
    from titan_ulysses.ops.norm import rms_norm

    monkeypatch.setattr(norm, "CHUNK_TOKENS", chunk)  # 14 tokens: 5 chunks, the last of 2

    torch.manual_seed(0)
    x = torch.randn(2, 7, 32, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(32)).to(dtype).requires_grad_()
    g = torch.randn(2, 7, 32, dtype=dtype)
    ref = torch.nn.functional.rms_norm(x.float(), (32,), w.float(), 1e-5).to(dtype)
    ref_grads = torch.autograd.grad(ref, (x, w), g)
    saved = []
    with saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = rms_norm(x, w, 1e-5)
    grads = torch.autograd.grad(out, (x, w), g)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **tol)
    # x as it came (no fp32 copy in bf16), the weight, one fp32 scale per token
    assert [(t.shape, t.dtype) for t in saved] == [(x.shape, dtype), (w.shape, dtype), ((2, 7, 1), torch.float32)]
    assert saved[0] is x or saved[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-5),
                                    (torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True),
                                     torch.randn(8, dtype=torch.float64, requires_grad=True)))
