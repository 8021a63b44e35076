"""gpt-oss (20b, 120b): attention with sinks and biases, alternating sliding / full layers, YaRN; every
layer a top-k-then-softmax router (with a bias) over experts with biases and a clamped SwiGLU.

Its experts are stacked in the files: ``gate_up_proj`` ``[E, D, 2F]`` with gate and up
interleaved along the last dim (``x @ W``), ``down_proj`` ``[E, F, D]`` -- our ``w2`` as it is.
The released checkpoints are MXFP4; this family reads the dequantised (bf16) ones.
"""

from __future__ import annotations

import dataclasses

from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.decoder.spec import DecoderSpec
from titan_ulysses.models.families.common import base_args, llama_tensors
from titan_ulysses.models.families.moe_common import aux_coef, check_capacity, feed_forward
from titan_ulysses.models.families.moe_memory import moe_layer_memory
from titan_ulysses.models.moe.args import MoEArgs
from titan_ulysses.models.registry import ExpertPart, HFConfigError, HFTensors, ModelFamily, register


def args_from_config(cfg: dict) -> DecoderArgs:
    check_capacity(cfg)
    if cfg.get("quantization_config"):
        raise HFConfigError(f"quantization_config {cfg['quantization_config'].get('quant_method', '?')!r}: the "
                            f"experts are quantized; use a dequantised (bf16) gpt-oss folder")
    bias = bool(cfg.get("attention_bias", True))
    moe = MoEArgs(num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                  hidden_dim=int(cfg["intermediate_size"]), router="topk_softmax", router_bias=True, expert_bias=True,
                  activation="clamped_swiglu", swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                  swiglu_limit=float(cfg.get("swiglu_limit", 7.0)), aux_loss_coef=aux_coef(cfg))
    args = base_args(cfg, "gpt_oss", sliding_window=cfg.get("sliding_window") or 0, qkv_bias=bias)
    types = list(cfg.get("layer_types") or [])
    return dataclasses.replace(args, o_bias=bias, attn_sinks=True, moe=moe, layer_types=types)


def hf_tensors(args: DecoderArgs) -> HFTensors:
    table = {k: v for k, v in llama_tensors(args).items() if ".mlp." not in k}
    for i in range(args.n_layers):
        theirs, ours = f"model.layers.{i}.", f"layers.{i}."
        if args.o_bias:
            table[f"{theirs}self_attn.o_proj.bias"] = [(f"{ours}attention.wo.bias", 0)]
        table[f"{theirs}self_attn.sinks"] = [(f"{ours}attention.sinks", 0)]
        mlp, ff = f"{theirs}mlp.", f"{ours}feed_forward."
        table[f"{mlp}router.weight"] = [(f"{ff}router.weight", 0)]
        table[f"{mlp}router.bias"] = [(f"{ff}router.bias", 0)]
        table[f"{mlp}experts.gate_up_proj"] = [ExpertPart(f"{ff}experts.w1", -1, "even"),
                                               ExpertPart(f"{ff}experts.w3", -1, "odd")]
        table[f"{mlp}experts.gate_up_proj_bias"] = [ExpertPart(f"{ff}experts.b1", -1, "even"),
                                                    ExpertPart(f"{ff}experts.b3", -1, "odd")]
        table[f"{mlp}experts.down_proj"] = [(f"{ff}experts.w2", 0)]
        table[f"{mlp}experts.down_proj_bias"] = [(f"{ff}experts.b2", 0)]
    return table


def export_config(args: DecoderArgs, config: dict) -> dict:
    m = args.moe
    return {"attention_bias": args.qkv_bias, "sliding_window": args.sliding_window or None,
            "layer_types": list(args.layer_types), "num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k,
            "swiglu_alpha": m.swiglu_alpha, "swiglu_limit": m.swiglu_limit,
            "output_router_logits": m.aux_loss_coef > 0, "router_aux_loss_coef": m.aux_loss_coef or 0.001}


register(ModelFamily("gpt_oss", "GptOssForCausalLM", args_from_config, hf_tensors, export_config, "yarn",
                     decoder=DecoderSpec(feed_forward=feed_forward, experts=True), layer_memory=moe_layer_memory))
