"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, a softmax top-k router over experts.

``norm_topk_prob`` renormalises the chosen experts' weights; ``decoder_sparse_step`` and
``mlp_only_layers`` keep some layers dense (``intermediate_size``), the others route to
``num_experts`` experts of ``moe_intermediate_size``. No shared experts in this family.
"""

from __future__ import annotations

import dataclasses

from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.decoder.spec import DecoderSpec
from titan_ulysses.models.families.common import base_args, check_common, llama_tensors, qk_norm_bytes
from titan_ulysses.models.families.moe_common import aux_coef, check_capacity, expert_tensors, feed_forward
from titan_ulysses.models.families.moe_memory import moe_layer_memory
from titan_ulysses.models.families.qwen import check_window
from titan_ulysses.models.moe.args import MoEArgs
from titan_ulysses.models.registry import HFConfigError, HFTensors, ModelFamily, register


def args_from_config(cfg: dict) -> DecoderArgs:
    check_common(cfg)
    check_window(cfg)
    check_capacity(cfg)
    if cfg.get("shared_expert_intermediate_size"):
        raise HFConfigError("shared_expert_intermediate_size: shared experts are Qwen2-MoE's, not in qwen3_moe")
    n, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step", 1))
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # the Hub's name; transformers 5 writes the other
    only = set(cfg.get("mlp_only_layers") or [])
    dense = [i for i in range(n) if i in only or not (experts > 0 and (i + 1) % step == 0)]
    moe = MoEArgs(num_experts=experts, top_k=int(cfg["num_experts_per_tok"]),
                  hidden_dim=int(cfg["moe_intermediate_size"]), norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                  aux_loss_coef=aux_coef(cfg))
    args = base_args(cfg, "qwen3_moe", default_head_dim=128, qk_norm=True)
    return dataclasses.replace(args, moe=moe if experts else None, moe_dense_layers=dense)


def hf_tensors(args: DecoderArgs) -> HFTensors:
    table = llama_tensors(args)
    for i in range(args.n_layers):
        if i not in args.moe_dense_layers:
            for x in ("gate", "up", "down"):
                del table[f"model.layers.{i}.mlp.{x}_proj.weight"]
    return {**table, **expert_tensors(args, "mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}, "gate")}


def export_config(args: DecoderArgs, config: dict) -> dict:
    m = args.moe
    return {"use_sliding_window": False, "attention_bias": False, "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.hidden_dim, "norm_topk_prob": m.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": list(args.moe_dense_layers),
            "output_router_logits": m.aux_loss_coef > 0, "router_aux_loss_coef": m.aux_loss_coef or 0.001}


def layer_memory(decoder_terms, args: DecoderArgs, layout, switches, mode: str) -> float:
    """The MoE layer's terms (``moe_memory.py``) and Qwen3's per-head q/k norms'."""
    return moe_layer_memory(decoder_terms, args, layout, switches, mode) + qk_norm_bytes(args, layout, switches, mode)


register(ModelFamily("qwen3_moe", "Qwen3MoeForCausalLM", args_from_config, hf_tensors, export_config, "yarn",
                     decoder=DecoderSpec(feed_forward=feed_forward, experts=True), layer_memory=layer_memory))
