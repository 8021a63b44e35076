"""TRL SFTTrainer at sp=N: its loss through TRL's own fused LM head, and its metrics as one process logs them.

TRL (1.16) gives the SFT model a fused LM head (``add_fused_lm_head``): called with
``fused_lm_head=True`` and pre-shifted ``shift_labels`` it returns per-token log-probabilities,
entropy and top-1 hits without ``[B, S, vocab]`` logits. One process's SFTTrainer scores through
it; so does this path, on this rank's S/sp tokens (``shard_batch``'s global ``shift_labels``), so
the loss is TRL's own arithmetic and no rank holds its slice's logits. ``entropy`` and
``mean_token_accuracy``: the slice's sums are added over every rank (each token on exactly one
rank) and divided as TRL divides; ``num_tokens`` counts the full rows' tokens (every sp rank holds
the same rows), summed over the dp ranks only. A TRL without the fused head is refused in one line.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

__all__ = ["UlyssesSFTMixin", "fused_head_refusal"]


def _summed(values: list, device) -> list[float]:
    """``values`` summed over every rank (one all-reduce), read on the host as TRL reads its metrics."""
    totals = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    dist.all_reduce(totals)
    return totals.tolist()


def fused_head_refusal(model) -> str | None:
    """Why ``model`` (the SFT trainer's, unwrapped) has no TRL fused LM head to score through; None when it has."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "fused_lm_head" not in inspect.signature(base.forward, follow_wrapped=False).parameters:  # TRL wraps it
        return ("ulysses_trainer: this SFTTrainer's model has no TRL fused LM head (TRL >= 1.16 adds one: "
                "`pip install 'trl>=1.16'`), which the sp path scores through")
    return None


class UlyssesSFTMixin:
    """Mixed in front of UlyssesTrainerMixin for SFTTrainer: TRL's fused head on this rank's slice, metrics reduced."""

    def _ulysses_forward(self, model, inputs: dict):
        local = self._ulysses_slice(inputs)
        labels = local["shift_labels"]  # [B, S/sp], global: token t's label is token t+1 of the full row
        outputs = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False,
                        shift_labels=labels, fused_lm_head=True)  # log_probs, entropy, is_top1: [B, S/sp]
        summed = -outputs.log_probs.float().sum()  # zero on ignored positions; bf16 under FSDP2 mixed precision
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]
        mask = inputs.get("attention_mask")  # TRL's token count: the mask's tokens, or the padding-free rows' width
        rows = mask.sum() if mask is not None else inputs["position_ids"].size(1)
        sums = [outputs.label_mask.sum(), outputs.entropy.detach().float().sum(), outputs.is_top1.sum(), rows]
        n, entropy, correct, tokens = _summed(sums, labels.device)  # one all-reduce over every rank
        metrics["entropy"].append(entropy / n if n > 0 else 0.0)
        metrics["mean_token_accuracy"].append(correct / n if n > 0 else 0.0)
        if mode == "train":  # every sp rank holds its dp rank's full rows: the sum over dp is the total over sp
            self._total_train_tokens += int(tokens) // self.ulysses_mesh["sp"].size() // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        return outputs, summed, labels
