"""Mixtral (8x7B, 8x22B): Mistral's attention (a window when config.json sets one), top-2 of 8 experts.

The router renormalises the chosen experts' weights (always); the experts are ``w1`` (gate),
``w3`` (up) and ``w2`` (down) of ``intermediate_size``, under ``block_sparse_moe``.
"""

from __future__ import annotations

import dataclasses

from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.decoder.spec import DecoderSpec
from titan_ulysses.models.families.common import base_args, check_common, llama_tensors
from titan_ulysses.models.families.moe_common import aux_coef, check_capacity, expert_tensors, feed_forward
from titan_ulysses.models.families.moe_memory import moe_layer_memory
from titan_ulysses.models.moe.args import MoEArgs
from titan_ulysses.models.registry import HFTensors, ModelFamily, register


def args_from_config(cfg: dict) -> DecoderArgs:
    check_common(cfg)
    check_capacity(cfg)
    moe = MoEArgs(num_experts=int(cfg.get("num_local_experts", 8)), top_k=int(cfg.get("num_experts_per_tok", 2)),
                  hidden_dim=int(cfg["intermediate_size"]), norm_topk_prob=True, aux_loss_coef=aux_coef(cfg))
    args = base_args(cfg, "mixtral", sliding_window=cfg.get("sliding_window") or 0)
    return dataclasses.replace(args, moe=moe)


def hf_tensors(args: DecoderArgs) -> HFTensors:
    table = {k: v for k, v in llama_tensors(args).items() if ".mlp." not in k}
    return {**table, **expert_tensors(args, "block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"}, "gate")}


def export_config(args: DecoderArgs, config: dict) -> dict:
    m = args.moe
    return {"sliding_window": args.sliding_window or None, "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.top_k, "output_router_logits": m.aux_loss_coef > 0,
            "router_aux_loss_coef": m.aux_loss_coef or 0.001, "router_jitter_noise": 0.0}


register(ModelFamily("mixtral", "MixtralForCausalLM", args_from_config, hf_tensors, export_config, "yarn",
                     decoder=DecoderSpec(feed_forward=feed_forward, experts=True), layer_memory=moe_layer_memory))
