"""TRL SFTTrainer's ``entropy``, ``mean_token_accuracy`` and ``num_tokens`` at sp=N, as one process logs them.

TRL computes them in its ``compute_loss`` (which ``ulysses_trainer`` replaces) from the per-token
outputs of the full rows, summed over the processes it gathers. Here each rank holds S/sp tokens of
its dp rows: it sums its slice's entropy, correct top-1 predictions and label tokens, the sums are
added over every rank (each token on exactly one rank), and divided as TRL divides. ``num_tokens``
counts the full rows' tokens (every sp rank holds the same rows), summed over the dp ranks only.
With ``loss_chunk_size`` (the fused loss) no logits exist: entropy and accuracy are not logged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_ulysses.ops.loss import IGNORE_INDEX

__all__ = ["UlyssesSFTMixin"]


def _summed(values: list, group, device) -> list[float]:
    """``values`` summed over the ranks of ``group`` (None: every rank), on the group's device."""
    totals = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    dist.all_reduce(totals, group=group)
    return totals.tolist()


def _slice_sums(logits: torch.Tensor, labels: torch.Tensor, chunk: int = 2048) -> list[torch.Tensor]:
    """This rank's (label tokens, summed entropy, correct top-1): logits [B, S/sp, V], shift_labels [B, S/sp].

    ``chunk`` label positions at a time, so the fp32 softmax adds at most [chunk, V] to the logits' memory."""
    keep = labels != IGNORE_INDEX  # [B, S/sp]
    entropy = torch.zeros((), dtype=torch.float64, device=logits.device)
    correct = torch.zeros((), dtype=torch.int64, device=logits.device)
    with torch.no_grad():
        positions = keep.flatten().nonzero().squeeze(1)  # the positions TRL scores
        flat, targets = logits.flatten(0, 1), labels.flatten()  # [B * S/sp, V], [B * S/sp]
        for start in range(0, positions.numel(), chunk):
            index = positions[start:start + chunk]
            part = flat[index].float()  # [chunk, V]
            logp = part.log_softmax(-1)
            entropy += -(logp.exp() * logp).sum().double()
            correct += (part.argmax(-1) == targets[index]).sum()
    return [keep.sum(), entropy, correct]


class UlyssesSFTMixin:
    """Mixed in front of UlyssesTrainerMixin for SFTTrainer: its metrics from this rank's slice, reduced over ranks."""

    def _ulysses_forward(self, model, inputs: dict):
        outputs, summed, labels = super()._ulysses_forward(model, inputs)
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]
        if not self.ulysses_loss_chunk:  # the fused loss builds no logits: nothing exact to log
            n, entropy, correct = _summed(_slice_sums(outputs.logits, labels), None, labels.device)
            metrics["entropy"].append(entropy / n if n > 0 else 0.0)
            metrics["mean_token_accuracy"].append(correct / n if n > 0 else 0.0)
        if mode == "train":  # TRL: the attention mask's tokens, or the padding-free rows' width
            mask = inputs.get("attention_mask")
            rows = mask.sum() if mask is not None else inputs["position_ids"].size(1)
            (tokens,) = _summed([rows], self.ulysses_mesh["dp"].get_group(), labels.device)
            self._total_train_tokens += int(tokens) // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        return outputs, summed, labels
