"""The GPU suite's peer loop and profile summary, proven on CPU before a GPU sees them
(``benchmarks/peer_transformers.py``, ``benchmarks/profile_summary.py``)."""

import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from benchmarks.peer_transformers import build_peer, run_peer
from benchmarks.profile_summary import part_of, profile
from titan_ulysses.ops.loss import PROFILE_RANGE, linear_cross_entropy_sum
from titan_ulysses.config.manager import load_config
from titan_ulysses.models.registry import num_params
from titan_ulysses.models.resolve import model_args

DEBUG = ["--config", "train_configs/debug_model.toml"]


def test_peer_is_our_shape_as_a_transformers_user_sets_it_up_and_trains():
    model, args = build_peer(DEBUG, torch.device("cpu"), "full", compile_on=True)
    ours = model_args(load_config(DEBUG), 0)
    assert args == ours and sum(p.numel() for p in model.parameters()) == num_params(ours)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 weights, bf16 autocast in the loop
    assert model.is_gradient_checkpointing and model.config._attn_implementation == "sdpa"
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)  # layer.compile()
    out = run_peer(DEBUG, 32, "none", False, steps=2, warmup=1, device=torch.device("cpu"))
    assert not out["oom"] and out["tok_s"] > 0 and abs(out["tok_s"] * out["step_s"] - 32) < 1e-6
    assert out["losses"][-1] < out["losses"][0], out["losses"]  # it trains (the same batch each step)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.out = nn.Embedding(32, 16), nn.Linear(16, 48), nn.Linear(16, 32)

    def forward(self, x):  # [B, S]
        q, k, v = self.qkv(self.emb(x)).view(*x.shape, 3, 2, 8).unbind(2)  # [B, S, H, D] each
        a = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return a.transpose(1, 2).flatten(2)  # [B, S, 16]: the output projection is the loss's


def test_profile_summary_of_a_cpu_step():
    torch.manual_seed(0)
    model = _Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # (AdamW on CPU reads its step count)
    data = (torch.randint(0, 32, (2, 16)) for _ in range(4))  # made when fetched, as a loader does
    pause = 0.03

    def step():
        with record_function("data"):
            x = next(data)
        with record_function("FSDP::all_gather_copy_out"):  # FSDP2's range name: a cast under it is FSDP's
            model.out.weight.data.copy_(model.out.weight.to(torch.float64).to(torch.float32))
        loss = linear_cross_entropy_sum(model(x), model.out.weight, x) / x.numel()  # the real (fused) loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()  # one scalar read a step
        time.sleep(pause)  # the host busy elsewhere: nothing computes

    summary, _ = profile(step, 2, cuda=False)
    parts = summary["parts_ms"]
    for part in ("data", "fsdp_casts", "attention", "linears", "loss", "optimizer"):
        assert parts[part] > 0, (part, summary)
    assert abs(sum(parts.values()) - summary["kernel_ms"]) < 1e-6
    assert summary["scalar_reads"] == 2 and summary["host_syncs"] == 0
    idle_ms = summary["span_ms"] - summary["busy_ms"]
    assert idle_ms >= pause * 1e3 * 0.95, summary  # the first sleep lies between two steps' work
    assert abs(summary["idle_between_kernels_pct"] - 100 * idle_ms / summary["span_ms"]) < 1e-6
    assert summary["top"][0]["ms"] >= summary["top"][-1]["ms"]


def test_kernels_are_placed_by_range_then_name():
    assert part_of("sm90_xmma_gemm_bf16bf16", []) == "linears"
    assert part_of("nvjet_tst_128x256", ["FSDP::post_backward (layers.0)"]) == "fsdp_casts"
    assert part_of("cudnn_generated_fort_native_sdpa_sm90", []) == "attention"
    assert part_of("flash_fwd_kernel", []) == "attention"
    assert part_of("fmha_cutlassF_bf16_aligned", []) == "attention"  # not a linear's cutlass
    assert part_of("multi_tensor_apply_kernel", ["cudaLaunchKernel", "aten::_fused_adamw_",
                                                  "Optimizer.step#AdamW.step"]) == "optimizer"
    assert part_of("Memcpy HtoD (Pinned -> Device)", []) == "data"
    assert part_of("triton_red_fused__log_softmax_0", []) == "loss"
    # the fused loss's matmuls by its range, the chunked loss's backward by its autograd node
    assert part_of("sm90_xmma_gemm_bf16bf16", ["aten::mm", PROFILE_RANGE]) == "loss"
    assert part_of("cutlass_80_simt_sgemm_128x256_8x4_nt_align1",
                   ["autograd::engine::evaluate_function: _ChunkedLinearCrossEntropyBackward"]) == "loss"
    assert part_of("triton_poi_fused_mul_silu_1", []) == "other"
