"""What a head stage's checkpoint keeps for backward: its attention kernel's outputs, without a leak.

Each head stage (``staged_attention.py``) is a non-reentrant checkpoint of its own. With
``parallelism.ulysses_stage_keep_attention`` (``module.stage_keep_attention``) the stage keeps
the outputs of the attention kernel (out and logsumexp: the ops ``ops.attention.save_ops()``
names, the ones selective AC keeps), so its backward recompute re-runs the projections, RoPE
and the exchanges but not the kernel. Where it keeps them depends on what encloses the stage:

* nothing (no AC): kept in the forward, as plain Ulysses keeps its attention outputs
  (a selective-checkpoint policy, ``create_selective_checkpoint_contexts``).
* the layer's checkpoint (full AC, full_offload, or selective AC): backward recomputes the
  whole layer, stages included, before it reaches any stage's backward. Keeping the outputs
  in the original forward would hold every layer's attention outputs until backward (the
  stage's checkpoint frame stays referenced by the graph). So the original forward keeps
  nothing; the layer's recompute, which runs inside backward, records each stage's kernel
  outputs on the module under (backward's graph task, stage); the stage's own recompute,
  which follows in the same backward, takes them from there and frees them. At most one
  layer's attention outputs are held this way at a time. Under selective AC the layer's
  recompute gets the kernel outputs from the layer's own cache, so the kernel runs once.

The stage's checkpoint is nested: the frame backward recomputes for the stage's gradient is
the one made in the original forward (the frame made during the layer's recompute belongs to
a graph nobody backpropagates), hence the hand-over through the module rather than a cache of
the frame. "Enclosed" means any saved-tensor hooks are active when the stage starts (a
checkpoint's own, or host offload's around it): where nothing then recomputes the stage, the
kernel simply runs again in its recompute (memory first, never a leak). Under torch.compile
the contexts run while AOT traces the graph (outside backward): enclosed stages tag every op
for recompute, as without the setting, and stages with nothing around them tag the kernel's
outputs to save.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titan_ulysses.ops.attention import save_ops as attention_save_ops

__all__ = ["compiled_stage_contexts", "stage_contexts"]


def _detached(x):
    return x.detach() if isinstance(x, torch.Tensor) else x


class _Record(TorchDispatchMode):
    """Run every op; append the kernel ops' outputs (detached) to ``store[op]``."""

    def __init__(self, ops: set, store: dict) -> None:
        super().__init__()
        self.ops, self.store = ops, store

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ops:
            self.store.setdefault(func, []).append(tree_map(_detached, out))
        return out


class _Replay(TorchDispatchMode):
    """Serve the kernel ops from what the layer's recompute recorded for this stage in this backward; run the rest."""

    def __init__(self, ops: set, module, stage: int) -> None:
        super().__init__()
        self.ops, self.module, self.stage = ops, module, stage
        self.store: dict = {}

    def __enter__(self):
        kept = getattr(self.module, "_stage_kept", None) or {}
        self.store = kept.pop((torch._C._current_graph_task_id(), self.stage), {})  # freed as it is consumed
        return super().__enter__()

    def __exit__(self, *exc):
        self.store = {}
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ops and self.store.get(func):
            return self.store[func].pop(0)
        return func(*args, **(kwargs or {}))


def _policy(ops, ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in ops else CheckpointPolicy.PREFER_RECOMPUTE


def stage_contexts(module, stage: int):
    """``context_fn`` for stage ``stage`` of ``module``'s checkpoint that keeps the kernel's outputs (see above)."""
    ops = attention_save_ops()
    if torch._C._autograd._top_saved_tensors_default_hooks(True) is None:  # nothing encloses the stage
        return create_selective_checkpoint_contexts(functools.partial(_policy, ops))
    gid = torch._C._current_graph_task_id()
    if gid == -1:  # the original forward: keep nothing (recompute-all modes: what compile needs too)
        forward, _ = create_selective_checkpoint_contexts(functools.partial(_policy, set()))
        return forward, _Replay(ops, module, stage)
    # the enclosing checkpoint's recompute inside backward: record for the stage's own recompute, next
    kept = getattr(module, "_stage_kept", None)
    if kept is None or any(key[0] != gid for key in kept):  # anything left from another backward goes
        kept = module._stage_kept = {}
    store: dict = {}
    kept[(gid, stage)] = store
    return _Record(ops, store), _Replay(set(), module, stage)


def compiled_stage_contexts():
    """``context_fn`` under torch.compile, where the contexts run once while AOT traces the block: what
    :func:`stage_contexts` then returns, without the module (a per-layer object in a compiled frame's
    arguments makes dynamo guard on its identity: one recompile per layer, past the recompile limit)."""
    enclosed = torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
    return create_selective_checkpoint_contexts(functools.partial(_policy, set() if enclosed else attention_save_ops()))
