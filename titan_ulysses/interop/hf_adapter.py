"""State-dict adapter between our names / RoPE layout and Hugging Face's, both ways, for every family.

The family (``models/registry.py``) lists its Hugging Face tensors and, for each, the
parts it is made of: one of ours renamed, or several concatenated along rows (Phi-3's
fused ``qkv_proj`` and ``gate_up_proj``).

Our RoPE rotates interleaved pairs ``(x[2i], x[2i+1])`` of each head; Hugging Face's
rotates halves ``(x[i], x[i + Dr/2])`` of the rotary features (``Dr``: all of the head,
or its first part with a partial rotary factor). Everything that lays out a head's
features along q or k is therefore permuted per head: the rows of wq and wk, the q/k
biases (Qwen2) and the per-head q/k norm weights (Qwen3, one "head" of Dh entries). v and
o are not rotated and keep their order.
"""

from __future__ import annotations

import torch

from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.registry import ExpertPart, HFTensors, get_family


def hf_tensors(args: DecoderArgs) -> HFTensors:
    """Hugging Face name -> [(our name, RoPE-ordered heads or 0), ...] for a model of ``args``."""
    return get_family(args.family).hf_tensors(args)


def _head_rows(w: torch.Tensor, n_heads: int, rotary_dim: int | None):
    head_dim = w.shape[0] // n_heads
    rotary = rotary_dim or head_dim
    heads = w.reshape(n_heads, head_dim, *w.shape[1:])
    return heads[:, :rotary], heads[:, rotary:], rotary


def interleaved_to_halves(w: torch.Tensor, n_heads: int, rotary_dim: int | None = None) -> torch.Tensor:
    """Reorder each head's rows (of a q/k weight, bias or norm weight) from RoPE pairs ``(2i, 2i+1)`` to ``(i, i+Dr/2)``.

    Per head the rotary rows become 0, 2, 4, ..., Dr-2, then 1, 3, ..., Dr-1 (rows past
    ``rotary_dim`` stay): HF's ``rotate_half`` then rotates exactly the pairs our
    ``apply_rope`` rotates, at the same frequencies, and q.k is unchanged because q and k
    are permuted alike.
    """
    rot, rest, r = _head_rows(w, n_heads, rotary_dim)
    rot = rot.reshape(n_heads, r // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(rot.shape)
    return torch.cat((rot, rest), dim=1).reshape(w.shape)


def halves_to_interleaved(w: torch.Tensor, n_heads: int, rotary_dim: int | None = None) -> torch.Tensor:
    """The inverse of :func:`interleaved_to_halves` (Hugging Face's layout to ours)."""
    rot, rest, r = _head_rows(w, n_heads, rotary_dim)
    rot = rot.reshape(n_heads, 2, r // 2, *w.shape[1:]).transpose(1, 2).reshape(rot.shape)
    return torch.cat((rot, rest), dim=1).reshape(w.shape)


def ours_to_theirs(w: torch.Tensor, heads: int, args: DecoderArgs) -> torch.Tensor:
    """One of our tensors in Hugging Face's layout (permuted if RoPE-ordered)."""
    return interleaved_to_halves(w, heads, args.rotary_dim) if heads else w


def theirs_to_ours(w: torch.Tensor, heads: int, args: DecoderArgs) -> torch.Tensor:
    return halves_to_interleaved(w, heads, args.rotary_dim) if heads else w


def join(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def part_name(part) -> str:
    """Our tensor a part of a Hugging Face tensor comes from."""
    return part.name if isinstance(part, ExpertPart) else part[0]


def is_expert(parts: list) -> bool:
    return isinstance(parts[0], ExpertPart)


def experts_to_theirs(parts: list[ExpertPart], ours: dict[str, torch.Tensor]) -> torch.Tensor:
    """One Hugging Face expert tensor from our stacked weights."""
    if parts[0].layout == "t":
        return ours[parts[0].name][parts[0].expert].T
    even, odd = (ours[p.name] for p in parts)  # [E, in, out] each -> [E, in, 2 out], interleaved
    return torch.stack((even, odd), dim=-1).flatten(-2)


def experts_from_theirs(w: torch.Tensor, parts: list[ExpertPart]) -> list[torch.Tensor]:
    """The inverse: ``ours[expert]`` for "t", else the even and odd places of the last dim."""
    if parts[0].layout == "t":
        return [w.T]
    return [w[..., 0::2], w[..., 1::2]]


def to_hf(state: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
    """Our full (unsharded) weights -> Hugging Face names and layout (fused projections joined)."""
    return {theirs: (experts_to_theirs(parts, state) if is_expert(parts)
                     else join([ours_to_theirs(state[ours], heads, args) for ours, heads in parts]))
            for theirs, parts in hf_tensors(args).items()}


def split(w: torch.Tensor, parts: list[tuple[str, int]], shapes: dict[str, tuple[int, ...]]) -> list[torch.Tensor]:
    """A Hugging Face tensor cut into its parts' rows (one part: itself)."""
    return [w] if len(parts) == 1 else list(w.split([shapes[ours][0] for ours, _ in parts], dim=0))


def from_hf(state: dict[str, torch.Tensor], args: DecoderArgs) -> dict[str, torch.Tensor]:
    """Hugging Face full weights -> our names and layout (extra keys, e.g. a tied lm_head, are ignored)."""
    shapes = our_shapes(args)
    out: dict[str, torch.Tensor] = {}
    for theirs, parts in hf_tensors(args).items():
        if is_expert(parts):
            for part, w in zip(parts, experts_from_theirs(state[theirs], parts)):
                if part.layout == "t":
                    out.setdefault(part.name, torch.empty(shapes[part.name], dtype=w.dtype))[part.expert] = w
                else:
                    out[part.name] = w.contiguous()
            continue
        for (ours, heads), w in zip(parts, split(state[theirs], parts, shapes)):
            out[ours] = theirs_to_ours(w, heads, args)
    return out


def our_shapes(args: DecoderArgs) -> dict[str, tuple[int, ...]]:
    """Our name -> shape for a model of ``args`` (built on the meta device, no memory)."""
    from titan_ulysses.models.registry import build_model

    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in build_model(args).state_dict().items()}


def expected_hf_shapes(args: DecoderArgs) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape for a model of ``args``."""
    shapes = our_shapes(args)
    out = {}
    for theirs, parts in hf_tensors(args).items():
        if is_expert(parts):
            s = shapes[parts[0].name]  # [E, in, out]
            out[theirs] = (s[2], s[1]) if parts[0].layout == "t" else (*s[:-1], 2 * s[-1])
        else:
            out[theirs] = (sum(shapes[o][0] for o, _ in parts), *shapes[parts[0][0]][1:])
    return out
