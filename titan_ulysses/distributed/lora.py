"""LoRA: a frozen base model with trainable low-rank adapters, laid out as peft lays them out.

``apply_lora`` runs inside ``parallelize`` after Ulysses / cp and before AC, compile and
FSDP2 (``DESIGN.md``). Every targeted projection ``y = x W^T (+ b)`` becomes

    y = x W^T (+ b) + (alpha / rank) * dropout(x) A^T B^T,     A: [rank, in], B: [out, rank]

with ``A`` initialised as peft does (Kaiming-uniform, a = sqrt(5)) and ``B`` at zero, so a
fresh adapter leaves the model unchanged. The module keeps its class's own forward (a plain
``nn.Linear`` or torchao's ``Float8Linear``) and its fully-qualified names: the base weight is
still ``layers.0.attention.wq.weight``, the adapters are ``...wq.lora_A`` / ``...wq.lora_B``,
so base checkpoints and Hugging Face folders load unchanged.

Every base parameter (embeddings, norms, output, every projection) is frozen
(``requires_grad=False``) and stored in the compute dtype: no gradient is ever computed or
reduced for it, the optimizer gets only the adapters (``optim.py``), and FSDP2 shards and
all-gathers it like any other parameter but reduce-scatters only the adapters' gradients.
The adapters stay fp32 master weights and compute under the same ``MixedPrecisionPolicy``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_ulysses.config.job_config import LORA_TARGETS, parse_lora_targets

# our projection name -> its module path inside a block
_PATHS = {"wq": "attention.wq", "wk": "attention.wk", "wv": "attention.wv", "wo": "attention.wo",
          "w1": "feed_forward.w1", "w3": "feed_forward.w3", "w2": "feed_forward.w2"}
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


@dataclass
class LoRAOptions:
    rank: int
    """Rank of the adapters (> 0)."""
    alpha: float = 16.0
    """The update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input (training only)."""
    targets: tuple[str, ...] = tuple(LORA_TARGETS)
    """Projections given adapters, by Hugging Face name (q_proj, ..., down_proj)."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def resolve_targets(names: str) -> tuple[str, ...]:
    """``"q_proj,wk,..."`` (Hugging Face names or ours) -> Hugging Face names in block order."""
    return parse_lora_targets(names)


class LoRAMixin:
    """Adds ``scaling * B(A(dropout(x)))`` to the output of the linear class it is mixed into."""

    lora_A: nn.Parameter  # [rank, in]
    lora_B: nn.Parameter  # [out, rank]
    lora_scaling: float
    lora_dropout: float

    def forward(self, x):  # [..., in] -> [..., out]
        out = super().forward(x)
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        return out + F.linear(F.linear(h, self.lora_A), self.lora_B) * self.lora_scaling  # via [..., rank]


_CLASSES: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    if issubclass(cls, LoRAMixin):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (LoRAMixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def clean_name(name: str) -> str:
    for prefix in _WRAPPERS:
        name = name.replace(prefix, "")
    return name


def lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name without AC/compile wrappers, module) of every adapted projection, in model order."""
    return [(clean_name(n), m) for n, m in model.named_modules() if isinstance(m, LoRAMixin)]


def apply_lora(model: nn.Module, options: LoRAOptions, compute_dtype: torch.dtype) -> None:
    """Freeze ``model`` (base parameters cast to ``compute_dtype``) and add fp32 adapters to the targets.

    Works on the meta device (before ``to_empty``); the adapters' values come from
    :func:`init_lora` (or a checkpoint).
    """
    if options.rank <= 0:
        raise ValueError(f"lora.rank must be > 0 to apply adapters, got {options.rank}")
    frozen: dict[int, nn.Parameter] = {}  # a tied parameter stays one object
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in frozen:
                    frozen[id(p)] = nn.Parameter(p.detach().to(compute_dtype), requires_grad=False)
                module._parameters[name] = frozen[id(p)]
    paths = tuple(_PATHS[LORA_TARGETS[t]] for t in options.targets)
    for name, module in model.named_modules():
        if not clean_name(name).endswith(paths):
            continue
        if not isinstance(module, nn.Linear):
            raise TypeError(f"lora: {name} is a {type(module).__name__}, not a linear layer")
        device = module.weight.device
        module.__class__ = _lora_class(type(module))
        module.lora_A = nn.Parameter(torch.empty(options.rank, module.in_features, device=device))
        module.lora_B = nn.Parameter(torch.empty(module.out_features, options.rank, device=device))
        module.lora_scaling = options.scaling
        module.lora_dropout = options.dropout
    if not lora_modules(model):
        raise ValueError(f"lora.target_modules {list(options.targets)} matched no module of the model")


def init_state(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Full (unsharded) initial adapters of ``model``, the same at every layout: A as peft, B zero."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, m in lora_modules(model):
        a = torch.empty(m.lora_A.shape)
        # peft's reset_lora_parameters: kaiming_uniform_(a=sqrt(5)) on A, zeros on B
        bound = math.sqrt(6.0 / ((1 + 5.0) * a.shape[1]))
        a.uniform_(-bound, bound, generator=g)
        state[f"{name}.lora_A"] = a
        state[f"{name}.lora_B"] = torch.zeros(m.lora_B.shape)
    return state


def init_lora(model: nn.Module, seed: int) -> None:
    """Give the (sharded) adapters of ``model`` their initial values (:func:`init_state`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, init_state(model, seed), options=StateDictOptions(full_state_dict=True, strict=False))


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of the full model (sharded parameters counted whole)."""
    seen, trainable, total = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()  # a DTensor's numel is its global size
        trainable += p.numel() if p.requires_grad else 0
    return trainable, total


def lora_options(section) -> LoRAOptions | None:
    """The ``[lora]`` section of a JobConfig as options for ``parallelize``; None when lora.rank is 0."""
    if section.rank == 0:
        return None
    return LoRAOptions(rank=section.rank, alpha=section.alpha, dropout=section.dropout,
                       targets=parse_lora_targets(section.target_modules))
