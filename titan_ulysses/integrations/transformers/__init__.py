"""Ulysses sequence parallelism for any transformers decoder: your loop, or transformers' Trainer and TRL.

- ``attention``: :func:`apply_ulysses`, the exchange around the model's own attention kernel;
- ``batch``: :func:`shard_batch` (this rank's slice), :func:`sp_loss` (the token mean of the
  whole mesh) and :func:`fsdp_mesh` (what ``fully_shard`` covers);
- ``trainer``: :func:`ulysses_trainer`, transformers' Trainer and TRL's SFT / DPO trainers at sp=N.

docs/transformers.md.
"""

from .attention import apply_ulysses
from .batch import fsdp_mesh, shard_batch, sp_loss
from .trainer import ulysses_trainer

__all__ = ["apply_ulysses", "fsdp_mesh", "shard_batch", "sp_loss", "ulysses_trainer"]
