"""What the mixture-of-experts families share: the feed-forward builder, config.json's router fields,
their tensors per expert, and the refusals of what would compute otherwise.

Experts are ``w1`` / ``w3`` ``[E, D, F]`` and ``w2`` ``[E, F, D]`` (``models/moe/experts.py``);
Hugging Face keeps them per expert, ``[F, D]`` / ``[D, F]`` for ``F.linear`` (Qwen3-MoE, Mixtral:
:func:`expert_tensors`), or stacked ``[E, D, 2F]`` with gate and up interleaved (gpt-oss, whose
family file says so).
"""

from __future__ import annotations

from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.decoder.feed_forward import dense
from titan_ulysses.models.moe.feed_forward import MoEFeedForward
from titan_ulysses.models.registry import ExpertPart, HFConfigError, HFTensors

def feed_forward(layer_id: int, args: DecoderArgs, compute):
    """The block's feed-forward: the experts, or the dense MLP on ``args.moe_dense_layers``."""
    if args.moe is None or layer_id in args.moe_dense_layers:
        return dense(layer_id, args, compute)
    return MoEFeedForward(args.dim, args.moe)


def check_capacity(cfg: dict) -> None:
    """Refuse routing that drops tokens: the result would depend on the layout (which tokens meet in a batch)."""
    for key in ("capacity_factor", "expert_capacity", "moe_capacity_factor"):
        if cfg.get(key):
            raise HFConfigError(f"config.json {key} {cfg[key]!r}: expert capacity drops tokens, so the result would "
                                f"depend on how tokens are batched and laid out; only dropless routing is supported")
    if cfg.get("router_jitter_noise"):
        raise HFConfigError(f"config.json router_jitter_noise {cfg['router_jitter_noise']!r}: random router noise is "
                            f"not supported; set it to 0")


def aux_coef(cfg: dict) -> float:
    """The load-balancing loss's weight as transformers applies it: only with ``output_router_logits``."""
    return float(cfg.get("router_aux_loss_coef", 0.001)) if cfg.get("output_router_logits") else 0.0


def expert_tensors(args: DecoderArgs, moe_prefix: str, names: dict[str, str], router: str) -> HFTensors:
    """Per-expert tensors of every MoE layer: ``{hf: [ExpertPart]}``; ``names``: ours (w1/w3/w2) -> theirs."""
    out: HFTensors = {}
    for i in range(args.n_layers):
        if i in args.moe_dense_layers:
            continue
        theirs, ours = f"model.layers.{i}.{moe_prefix}.", f"layers.{i}.feed_forward."
        out[f"{theirs}{router}.weight"] = [(f"{ours}router.weight", 0)]
        for e in range(args.moe.num_experts):
            for w, hf in names.items():
                out[f"{theirs}experts.{e}.{hf}.weight"] = [ExpertPart(f"{ours}experts.{w}", e, "t")]
    return out
