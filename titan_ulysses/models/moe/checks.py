"""What a mixture of experts cannot be combined with here, refused in one line each before any process group."""

from __future__ import annotations

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def check_moe(args, ep: int, tp: int, lora_targets: tuple[str, ...] | None, source: str) -> None:
    """``args``: the model's (DecoderArgs); ``lora_targets``: Hugging Face names, None without LoRA."""
    moe = args.moe
    if moe is None:
        if ep > 1:
            raise ValueError(f"parallelism.expert_parallel_degree {ep} needs a mixture-of-experts model; {source} has "
                             f"no experts: set expert_parallel_degree 1")
        return
    if moe.num_experts % ep:
        divisors = [d for d in range(1, moe.num_experts + 1) if moe.num_experts % d == 0]
        raise ValueError(f"parallelism.expert_parallel_degree {ep} does not divide the {moe.num_experts} experts of "
                         f"{source}; use one of {divisors}")
    if tp > 1:
        raise ValueError(f"parallelism.tensor_parallel_degree {tp} with a mixture of experts ({source}) is not "
                         f"supported: shard the experts with expert_parallel_degree instead")
    on_experts = [t for t in lora_targets or () if t in EXPERT_PROJECTIONS]
    if on_experts and len(args.moe_dense_layers) < args.n_layers:
        raise ValueError(f"lora.target_modules {','.join(on_experts)}: LoRA on experts is not supported ({source} routes its "
                         f"feed-forward to experts); use lora.target_modules q_proj,k_proj,v_proj,o_proj")
