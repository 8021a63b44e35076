"""Ulysses sequence parallelism for torchtitan users (pinned: torchtitan 0.3.x).

torchtitan 0.3 models attention as a swappable ``inner_attention`` module called as
``inner_attention(q, k, v, attention_masks=..., scale=..., enable_gqa=...)`` on
``[B, L, N, H]`` tensors, and its decoder passes ``positions`` down to RoPE. That is all
Ulysses needs:

* :func:`apply_ulysses_to_torchtitan` wraps every ``inner_attention`` in
  :class:`~titan_ulysses.distributed.ulysses.UlyssesAttention` (one all-to-all in, one
  out, kv heads replicated when there are fewer than the SP degree), optionally swapping
  the local kernel for one of ours (``sdpa`` with FlashAttention/cuDNN kernels and dense
  document masks, ``flex``, ``flash_attn`` varlen), and makes RoPE positions global on
  every rank: a rank holding tokens ``[r*S/P, (r+1)*S/P)`` rotates them by their positions
  in the full sequence.
* :func:`prepare_ulysses_inputs` shards one full batch for this rank (padding S up to a
  multiple of P, padding labels ignored) and builds the attention mask of the *full*
  sequence, which is what the local attention sees after the exchange.
* For torchtitan's own trainer, Ulysses takes the ``cp`` mesh dimension: torchtitan
  already shards FSDP over ``dp_shard x cp`` and counts tokens for the loss the way
  sequence parallelism needs. :class:`UlyssesTrainer` replaces ring-attention input
  sharding with :func:`prepare_ulysses_inputs`, :func:`parallelize_llama_ulysses` applies
  Ulysses instead of ring attention, and the ``llama3_*_ulysses`` functions below are
  config-registry entries, so that::

      torchrun --nproc-per-node 8 -m torchtitan.train \\
          --module titan_ulysses.integrations.torchtitan --config llama3_8b_ulysses \\
          --parallelism.context_parallel_degree 8

  trains torchtitan's Llama 3 with Ulysses degree 8 (``sdpa`` local attention by default,
  which torchtitan 0.3 no longer offers for language models).

torchtitan is an optional extra: ``pip install 'titan_ulysses[torchtitan]'``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_ulysses.data.sharding import shard_batch
from titan_ulysses.distributed.ulysses import UlyssesAttention, check_heads
from titan_ulysses.ops.attention import BACKENDS, build_attention, build_attention_mask

SUPPORTED_TORCHTITAN = "0.3."


def require_torchtitan():
    """Import torchtitan, refusing a missing or unsupported release with the install line."""
    try:
        import torchtitan
    except ImportError as e:
        raise ImportError(
            "the torchtitan integration needs torchtitan 0.3.x: pip install 'titan_ulysses[torchtitan]'"
        ) from e
    version = getattr(torchtitan, "__version__", "0.0.0")
    if not version.startswith(SUPPORTED_TORCHTITAN):
        raise ImportError(
            f"torchtitan {version} is installed but the integration supports {SUPPORTED_TORCHTITAN}x; "
            f"pip install 'titan_ulysses[torchtitan]'"
        )
    return torchtitan


class TorchtitanLocalAttention(nn.Module):
    """One of our local attention backends behind torchtitan's inner-attention signature.

    ``attention_masks`` is the mask object :func:`ops.attention.build_attention_mask` makes
    for the backend (``None``: causal); :func:`prepare_ulysses_inputs` builds it.
    """

    def __init__(self, backend: str):
        super().__init__()
        self.backend = backend
        self.attention = build_attention(backend)

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, is_causal=True, **kwargs):
        # q: [B, S, Hq, H_dim], k/v: [B, S, Hkv, H_dim]; enable_gqa follows from the shapes
        if not is_causal:
            raise ValueError("titan_ulysses local attention is causal only (got is_causal=False)")
        return self.attention(q, k, v, attention_masks, scale=scale)

    def extra_repr(self) -> str:
        return f"backend={self.backend}"


def _global_positions_hook(sp_mesh: DeviceMesh):
    """A forward pre-hook giving the decoder the global positions of this rank's tokens."""
    sp, rank = sp_mesh.size(), sp_mesh.get_local_rank()

    def hook(module, args, kwargs):
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        tokens = bound.arguments["tokens"]  # [B, S/P]
        positions = bound.arguments.get("positions")
        b, s_local = tokens.shape[:2]
        if positions is None:
            offset = rank * s_local
            positions = torch.arange(offset, offset + s_local, device=tokens.device).expand(b, s_local)
        elif positions.shape[-1] == s_local * sp and sp > 1:
            positions = positions.chunk(sp, dim=-1)[rank]  # the full sequence's positions: take ours
        elif positions.shape[-1] != s_local:
            raise ValueError(
                f"positions of length {positions.shape[-1]} match neither this rank's {s_local} tokens "
                f"nor the full sequence of {s_local * sp}"
            )
        bound.arguments["positions"] = positions  # [B, S/P]
        return bound.args, bound.kwargs

    return hook


def apply_ulysses_to_torchtitan(
    model: nn.Module, sp_mesh: DeviceMesh, attn_backend: str | None = None, tp_degree: int = 1
) -> nn.Module:
    """Turn a torchtitan decoder (e.g. ``Llama3Model``) into a Ulysses model over ``sp_mesh``.

    ``attn_backend`` (``sdpa``, ``flex`` or ``flash_attn``) swaps torchtitan's inner
    attention for ours; ``None`` keeps torchtitan's (its masks must then cover the full
    sequence). Feed the model this rank's tokens ``[B, S/P]`` (see
    :func:`prepare_ulysses_inputs`); positions may be omitted (then ``0..S-1``), or be this
    rank's slice of the full sequence's positions, or the full sequence's positions.
    Apply it before tensor parallelism, FSDP and compile.
    """
    require_torchtitan()
    if attn_backend is not None and attn_backend not in BACKENDS:
        raise ValueError(f"attn_backend {attn_backend!r} is not one of {list(BACKENDS)}")
    if sp_mesh.ndim != 1:
        raise ValueError(f"apply_ulysses_to_torchtitan needs a 1-D sp mesh, got {sp_mesh.ndim} dims")
    sp = sp_mesh.size()
    wrapped = 0
    for module in list(model.modules()):
        inner = getattr(module, "inner_attention", None)
        if not isinstance(inner, nn.Module) or isinstance(inner, UlyssesAttention):
            continue
        n_heads = getattr(module, "n_heads", None)
        if n_heads is not None:
            check_heads(n_heads, getattr(module, "n_kv_heads", None) or n_heads, sp, tp_degree)
        if attn_backend is not None:
            inner = TorchtitanLocalAttention(attn_backend)
        module.inner_attention = UlyssesAttention(inner, sp_mesh)
        wrapped += 1
    if wrapped == 0:
        raise ValueError("apply_ulysses_to_torchtitan found no `inner_attention` module in the model")
    model.register_forward_pre_hook(_global_positions_hook(sp_mesh), with_kwargs=True)
    return model


def document_ids_from_positions(positions: torch.Tensor) -> torch.Tensor | None:
    """torchtitan marks packed documents by positions restarting at 0; None when each row is one document."""
    b, s = positions.shape
    if torch.equal(positions, torch.arange(s, device=positions.device).expand(b, s)):
        return None
    return torch.cumsum(positions == 0, dim=1) - 1  # [B, S]


def prepare_ulysses_inputs(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    sp_mesh: DeviceMesh,
    positions: torch.Tensor | None = None,
    attn_backend: str | None = "sdpa",
    model: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """This rank's ``(tokens, labels, extra_kwargs)`` for the forward, from the full batch ``[B, S]``.

    ``extra_kwargs`` holds this rank's global ``positions`` and, for packed documents,
    ``attention_masks`` over the full padded sequence: ours for ``attn_backend``, or, with
    ``attn_backend=None``, torchtitan's own from ``model.get_attention_masks``.
    """
    sp, rank = sp_mesh.size(), sp_mesh.get_local_rank()
    document_ids = None if positions is None else document_ids_from_positions(positions)
    batch = shard_batch(tokens, labels, rank, sp, positions=positions, document_ids=document_ids)
    extra: dict = {"positions": batch.positions}  # [B, S_pad/P]
    if attn_backend is not None:
        if batch.document_ids is not None:
            extra["attention_masks"] = build_attention_mask(attn_backend, batch.document_ids)
    elif model is not None and positions is not None:
        # torchtitan's masks read document starts from positions: padding (positions
        # continuing past S) stays in the last document, behind every real token.
        b, s = positions.shape
        s_pad = batch.positions.shape[1] * sp
        tail = torch.arange(s, s_pad, device=positions.device).expand(b, s_pad - s)
        extra["attention_masks"] = model.get_attention_masks(positions=torch.cat([positions, tail], dim=1))
    return batch.tokens, batch.labels, extra


# -- torchtitan's trainer ------------------------------------------------------------------


def parallelize_llama_ulysses(model: nn.Module, *, parallel_dims, attn_backend: str | None = "sdpa", **kwargs):
    """torchtitan's ``parallelize_llama`` with Ulysses on the ``cp`` mesh instead of ring attention."""
    from torchtitan.models.llama3.parallelize import parallelize_llama

    if parallel_dims.cp_enabled:
        apply_ulysses_to_torchtitan(
            model, parallel_dims.get_mesh("cp"), attn_backend, tp_degree=parallel_dims.tp
        )
        parallel_dims = _WithoutRingCP(parallel_dims)
    return parallelize_llama(model, parallel_dims=parallel_dims, **kwargs)


class _WithoutRingCP:
    """torchtitan's ParallelDims, except that ``parallelize_llama`` must not add ring attention."""

    def __init__(self, parallel_dims):
        self._dims = parallel_dims

    cp_enabled = False

    def __getattr__(self, name):
        return getattr(self._dims, name)


def _trainer_class():
    require_torchtitan()
    from torchtitan.trainer import Trainer

    class UlyssesTrainer(Trainer):
        """torchtitan's Trainer whose ``cp`` dimension runs Ulysses.

        Only the input preparation differs from torchtitan's: the batch is split into
        contiguous slices (no load balancing: the all-to-all restores the order) and the
        attention mask is built for the full sequence.
        """

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(Trainer.Config):
            pass

        def post_dataloading_process(self, input_dict, labels):
            if not self.parallel_dims.cp_enabled:
                return super().post_dataloading_process(input_dict, labels)
            extra = {k: v for k, v in input_dict.items() if k != "input"}
            positions = extra.pop("positions", None)
            model = self.model_parts[0]
            inner = _first_inner_attention(model)
            backend = inner.backend if isinstance(inner, TorchtitanLocalAttention) else None
            tokens, labels, ulysses_extra = prepare_ulysses_inputs(
                input_dict["input"], labels, self.parallel_dims.get_mesh("cp"), positions, backend, model
            )
            extra.update(ulysses_extra)
            self.ntokens_seen += labels.numel()
            return tokens, labels, extra

    return UlyssesTrainer


def _first_inner_attention(model: nn.Module) -> nn.Module | None:
    for module in model.modules():
        if isinstance(module, UlyssesAttention):
            return module.local_attention
    return None


def ulysses_trainer_config(base, attn_backend: str | None = "sdpa"):
    """A torchtitan ``Trainer.Config`` turned into a Ulysses one (trainer and parallelize function)."""
    trainer_cls = _trainer_class()
    config = trainer_cls.Config(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
    config.model_spec = dataclasses.replace(
        base.model_spec,
        parallelize_fn=functools.partial(parallelize_llama_ulysses, attn_backend=attn_backend),
    )
    config.parallelism.context_parallel_load_balancer = None  # Ulysses needs contiguous slices
    return config


def llama3_debugmodel_ulysses():
    """torchtitan's ``llama3_debugmodel`` with Ulysses on the cp dimension (degree 2 by default)."""
    require_torchtitan()
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = ulysses_trainer_config(llama3_debugmodel())
    config.parallelism.context_parallel_degree = 2
    return config


def llama3_8b_ulysses():
    """torchtitan's ``llama3_8b`` with Ulysses on the cp dimension (set its degree on the command line)."""
    require_torchtitan()
    from torchtitan.models.llama3.config_registry import llama3_8b

    return ulysses_trainer_config(llama3_8b())
