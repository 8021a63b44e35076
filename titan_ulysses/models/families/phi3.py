"""Phi-3 / 3.5 / 4 (``model_type`` phi3): fused ``qkv_proj`` and ``gate_up_proj``, longrope, partial rotary.

The fused projections are split into our wq / wk / wv and w1 / w3 on load and joined on
export (rows: q, k, v; gate, up), so TP, Ulysses and FSDP see the Llama block unchanged.
Phi-4-mini rotates the first ``partial_rotary_factor`` of each head only.
"""

from __future__ import annotations

from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.families.common import base_args, check_common, llama_tensors
from titan_ulysses.models.registry import HFTensors, ModelFamily, register


def args_from_config(cfg: dict) -> DecoderArgs:
    check_common(cfg)
    # Phi3Config's class default, which transformers prefers to rope_scaling's for longrope
    cfg = {**cfg, "original_max_position_embeddings": cfg.get("original_max_position_embeddings") or 4096,
           "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5)}
    return base_args(cfg, "phi3", sliding_window=cfg.get("sliding_window") or 0)


def hf_tensors(args: DecoderArgs) -> HFTensors:
    table = llama_tensors(args)
    for i in range(args.n_layers):
        theirs = f"model.layers.{i}."
        q, k, v = (table.pop(f"{theirs}self_attn.{x}_proj.weight")[0] for x in "qkv")
        table[f"{theirs}self_attn.qkv_proj.weight"] = [q, k, v]
        gate, up = (table.pop(f"{theirs}mlp.{x}_proj.weight")[0] for x in ("gate", "up"))
        table[f"{theirs}mlp.gate_up_proj.weight"] = [gate, up]
    return table


def export_config(args: DecoderArgs, config: dict) -> dict:
    out = {"sliding_window": args.sliding_window or None, "partial_rotary_factor": args.rotary_fraction}
    if args.rope_scaling is not None:  # transformers prefers this top-level key over rope_scaling's
        out["original_max_position_embeddings"] = args.rope_scaling.original_max_position_embeddings
    return out


register(ModelFamily("phi3", "Phi3ForCausalLM", args_from_config, hf_tensors, export_config))
