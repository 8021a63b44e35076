"""``config/`` is a leaf: it imports nothing of ours, so its lists of choices are copies. Each copy must
equal the registry or table that owns the choice, or a setting would be accepted at parse time and
refused (or silently ignored) later."""

import pytest

from titan_ulysses.checkpoint.manager import ASYNC_MODES
from titan_ulysses.config.job_config import CHOICES
from titan_ulysses.distributed.activation_checkpoint import AC_MODES
from titan_ulysses.distributed.float8 import RECIPES
from titan_ulysses.models.extension import METHODS
from titan_ulysses.models.rope import ROPE_TYPES
from titan_ulysses.ops.attention.registry import BACKENDS
from titan_ulysses.ops.loss.registry import BACKENDS as LOSS_BACKENDS
from titan_ulysses.optim import DECAY_TYPES

OWNERS = {
    "model.attn_backend": tuple(BACKENDS),
    "model.loss_backend": tuple(LOSS_BACKENDS),
    "model.rope_scaling_type": ("",) + METHODS,  # "": the model's own method
    "activation_checkpoint.mode": AC_MODES,
    "lr_scheduler.decay_type": DECAY_TYPES,
    "float8.recipe": RECIPES,
    "checkpoint.async_mode": ASYNC_MODES,
}


@pytest.mark.parametrize("key", sorted(OWNERS))
def test_config_choices_equal_their_registry(key):
    assert set(CHOICES[key]) == set(OWNERS[key]), f"config/job_config.py CHOICES[{key!r}] is out of date"


def test_every_extension_method_is_a_rope_type():
    assert set(METHODS) <= set(ROPE_TYPES)
