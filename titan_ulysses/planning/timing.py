"""Time of one training step, from the config alone: FLOPs per part at a device's achieved rates, plus traffic.

Beside the memory model (``estimate.py``): where that adds up bytes per phase, this adds up seconds per part of
a rank's step -- the block matmuls, the attention kernel (fwd+bwd, and its forward again where activation
checkpointing recomputes it), the loss's output projection, the memory-bound rest (norms, RoPE, SwiGLU,
residuals, the loss's fp32 softmax) at the device's bandwidth, the tiled MLP's recomputed forward, the
activations full_offload (and the shards FSDP CPU offload) move to the host and back, and the traffic of the ranks' exchanges (the all-to-all of Ulysses, cp's K/V all-gather, FSDP's
gathers and reduce-scatters) at the link bandwidth. The rates are ``rates.py``'s (device, date and what they
come from); ``scripts/check_timing.py`` prints the model's error against every measured cell
(``measured.py``). What a full recompute repeats: the forward of the blocks; with head stages that keep their
attention outputs (``parallelism.ulysses_stage_keep_attention``) not the attention kernel -- the model's
reading of why stages are faster, which no profile has confirmed yet (docs/bench_devices.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_ulysses.metrics.flops import flops_per_token
from titan_ulysses.planning.inputs import Layout, Switches
from titan_ulysses.planning.rates import DeviceRates


TRAFFIC = ("all-to-all", "cp all-gather", "FSDP beyond compute")
"""The parts a simulated rank (a fake process group) does not have."""


@dataclass
class StepTime:
    """Seconds of one rank's step by part; ``total`` is their sum (compute does not overlap itself; FSDP's
    traffic overlaps compute and counts only where it is longer)."""

    parts: dict[str, float] = field(default_factory=dict)
    tokens: float = 0.0  # tokens a rank processes per step
    flops_per_token: float = 0.0  # metrics/flops.py's, the MFU's numerator
    peak_flops: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def tok_s(self) -> float:
        return self.tokens / self.total

    @property
    def mfu_pct(self) -> float:
        return 100 * self.tok_s * self.flops_per_token / self.peak_flops


_COUNTED: dict[str, float] = {}


def _counted(args, seq_len: int) -> tuple[float, float]:
    """(``metrics/flops.py``'s FLOPs per token at ``seq_len``, the parameters the step moves). flops.py builds the
    model on the meta device to count them: once per shape (at length 0, its matmuls alone; attention is added
    at each length as flops.py adds it)."""
    key = repr(args)
    if key not in _COUNTED:
        _COUNTED[key] = flops_per_token(args, 0)
    matmuls = _COUNTED[key]
    attention = 3 * 4 * args.n_layers * args.n_heads * args.head_dim * seq_len / 2
    untied_input = 0 if args.tie_embeddings else args.vocab_size * args.dim
    return matmuls + attention, matmuls / 6 + untied_input


def flop_parts(args, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token (fwd + bwd) split as ``metrics/flops.py`` counts them: the blocks' matmuls,
    the output projection (the loss's), the attention kernel."""
    total = _counted(args, seq_len)[0]
    attention = 3 * 4 * args.n_layers * args.n_heads * args.head_dim * seq_len / 2
    output = 6 * args.vocab_size * args.dim
    return {"blocks": total - attention - output, "output": output, "attention": attention}


def _memory_bound_bytes(args, s: Switches) -> tuple[float, float]:
    """(blocks, loss) bytes per token read and written by the memory-bound ops of one fwd + bwd (2x the forward):
    per layer the two norms, RoPE and the residual adds on [D] rows, SwiGLU on [F] rows; the loss's fp32
    logits (a chunked softmax reads and writes them about three times each way)."""
    a, d, f = s.act_bytes, args.dim, args.ffn_hidden_dim
    per_layer = a * (10 * d + 3 * f)
    return 3 * args.n_layers * per_layer, 6 * 4 * args.vocab_size


def step_time(args, layout: Layout, s: Switches, seq_len: int, rates: DeviceRates, local_batch: int = 1,
              compiled: bool = True, precision: str = "bf16", attention: str = "cudnn", simulated: bool = False,
              link_gbs: float | None = None) -> StepTime:
    """Seconds of one rank's steady-state step (``simulated``: a fake process group, no traffic at all)."""
    tokens = local_batch * seq_len / (layout.sp * layout.cp)  # T, per rank
    fl = flop_parts(args, seq_len)
    mm = rates.matmul_tflops * 1e12
    full = s.ac_mode in ("full", "full_offload")
    keeps_attention = s.head_stages > 1 and s.stage_keep_attention
    linear = rates.float8_linear_speedup if precision == "float8" else 1.0
    parts = {
        "block matmuls": tokens * fl["blocks"] * (1 + (1 / 3 if full else 0)) / (mm * linear),
        "output projection": tokens * fl["output"] / mm,
        "attention": tokens * fl["attention"] / (rates.attention_fraction[attention] * mm),
    }
    if s.mlp_tile_size:  # the tiled MLP recomputes its forward in backward (ops/tiled.py), in every AC mode
        mlp = 6 * 3 * args.dim * args.ffn_hidden_dim * args.n_layers / layout.tp
        parts["tiled MLP recompute"] = tokens * mlp / 3 / (mm * linear)
    if full and not keeps_attention:  # the kernel's forward again in the recompute
        parts["attention recompute"] = tokens * fl["attention"] / 3 / (rates.attention_fwd_fraction[attention] * mm)
    blocks_bytes, loss_bytes = _memory_bound_bytes(args, s)
    recompute = 1 / 3 if s.ac_mode != "none" else 0.0  # selective recomputes these too
    memory_bound = tokens * (blocks_bytes * (1 + recompute) + loss_bytes) / (rates.hbm_gbs * 1e9 * rates.hbm_efficiency)
    parts["memory-bound ops"] = memory_bound * (1.0 if compiled else rates.eager_memory_factor)
    if s.ac_mode == "full_offload":  # block inputs out in forward, back in backward, not all hidden
        moved = 2 * args.n_layers * s.act_bytes * args.dim * tokens
        parts["offload (exposed)"] = moved / (rates.host_exposed_gbs * 1e9)
    if s.cpu_offload:  # FSDP CPU offload: the shards of parameters in and gradients out every step
        parts["FSDP CPU offload"] = 8 * _counted(args, seq_len)[1] / (layout.dp_shard * layout.cp * layout.sp) / (
            rates.host_exposed_gbs * 1e9)
    if not simulated:
        parts.update(_traffic(args, layout, s, tokens, sum(parts.values()), link_gbs or rates.link_gbs,
                              _counted(args, seq_len)[1]))
    return StepTime(parts=parts, tokens=tokens, flops_per_token=_counted(args, seq_len)[0],
                    peak_flops=rates.peak_tflops * 1e12)


def _traffic(args, layout: Layout, s: Switches, tokens: float, compute_s: float, link_gbs: float,
             n_params: int) -> dict:
    """The exchanges' seconds at ``link_gbs`` (GB/s per direction per rank, ``comm.link_bandwidth_gbps``): the
    all-to-all (q, k, v in and the output back, each way again in backward and in a full recompute) and cp's K/V
    all-gather are on the step's path; FSDP's gathers and reduce-scatters overlap compute and count beyond it."""
    bw = link_gbs * 1e9
    a, hd = s.act_bytes, args.head_dim
    out: dict[str, float] = {}
    passes = 3 if s.ac_mode in ("full", "full_offload") else 2  # fwd, bwd, and the recompute's fwd
    if layout.sp > 1:
        per_token = a * hd * (2 * args.n_heads + 2 * args.n_kv_heads) * args.n_layers
        out["all-to-all"] = passes * tokens * per_token * (layout.sp - 1) / layout.sp / bw
    if layout.cp > 1:
        out["cp all-gather"] = passes * tokens * 2 * a * hd * args.n_kv_heads * args.n_layers * (layout.cp - 1) / bw
    n = layout.dp_shard * layout.cp * layout.sp
    if n > 1:
        params = n_params / layout.tp
        fsdp = (2 * a + 4) * params * (n - 1) / n / bw  # gathers fwd and bwd, fp32 reduce-scatter
        if s.ac_mode in ("full", "full_offload"):
            fsdp += a * params * (n - 1) / n / bw  # the recompute gathers again
        out["FSDP beyond compute"] = max(fsdp - compute_s, 0.0)
    return out
