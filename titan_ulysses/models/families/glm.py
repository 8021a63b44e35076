"""GLM-4 (``model_type`` glm, GLM-4-9B-chat-hf): Llama's block, q/k/v biases, fused ``gate_up_proj``, half-rotary RoPE.

GLM rotates interleaved pairs ``(x[2i], x[2i+1])`` of the first ``partial_rotary_factor`` (0.5
by default) of each head, exactly as our RoPE does: its q/k rows load in their own order (no
per-head permutation, unlike Llama's halves). ``gate_up_proj`` is split into our w1 / w3 on
load and joined on export (rows: gate, up), as Phi-3's.
"""

from __future__ import annotations

from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.families.common import base_args, check_common, llama_tensors
from titan_ulysses.models.registry import HFTensors, ModelFamily, register


def args_from_config(cfg: dict) -> DecoderArgs:
    check_common(cfg, biases=("mlp_bias",))
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    # GlmConfig's defaults where config.json is silent
    cfg = {**cfg, "head_dim": cfg.get("head_dim", 128), "rms_norm_eps": cfg.get("rms_norm_eps", 1.5625e-07),
           "partial_rotary_factor": rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)),
           "pad_token_id": cfg.get("pad_token_id", 151329)}
    return base_args(cfg, "glm", qkv_bias=bool(cfg.get("attention_bias", True)))


def hf_tensors(args: DecoderArgs) -> HFTensors:
    table = {theirs: [(ours, 0) for ours, _ in parts] for theirs, parts in llama_tensors(args).items()}
    for i in range(args.n_layers):
        theirs = f"model.layers.{i}."
        gate, up = (table.pop(f"{theirs}mlp.{x}_proj.weight")[0] for x in ("gate", "up"))
        table[f"{theirs}mlp.gate_up_proj.weight"] = [gate, up]
    return table


def export_config(args: DecoderArgs, config: dict) -> dict:
    return {"attention_bias": args.qkv_bias, "partial_rotary_factor": args.rotary_fraction}


register(ModelFamily("glm", "GlmForCausalLM", args_from_config, hf_tensors, export_config))
