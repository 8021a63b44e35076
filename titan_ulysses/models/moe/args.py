"""What a mixture-of-experts feed-forward is: the family's config.json says, the decoder builds it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEArgs:
    num_experts: int
    """Routed experts per MoE layer (config.json ``num_experts`` / ``num_local_experts``)."""
    top_k: int
    """Experts each token is sent to (``num_experts_per_tok``)."""
    hidden_dim: int
    """Each expert's intermediate size (``moe_intermediate_size``, or ``intermediate_size`` for Mixtral and gpt-oss)."""
    router: str = "softmax_topk"
    """"softmax_topk": softmax over all experts, then the top k (Qwen3-MoE, Mixtral); "topk_softmax":
    the top k logits, then a softmax over them (gpt-oss)."""
    norm_topk_prob: bool = True
    """softmax_topk: renormalise the top-k probabilities to sum to 1 (Mixtral always; Qwen3-MoE by config)."""
    router_bias: bool = False
    """The router's linear layer has a bias (gpt-oss)."""
    expert_bias: bool = False
    """The experts' projections have biases (gpt-oss)."""
    activation: str = "swiglu"
    """"swiglu": silu(gate) * up; "clamped_swiglu": gpt-oss's, with ``swiglu_alpha`` and ``swiglu_limit``."""
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss in the training loss (``router_aux_loss_coef``); 0: off."""
