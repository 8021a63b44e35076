"""Context parallelism (``cp``) beside Ulysses: all-gather K and V, attend with the local queries.

Ulysses splits attention by heads, so it cannot split a sequence over more ranks than there
are heads. Context parallelism splits it further without touching heads: the sequence is
laid out over ``cp x sp`` ranks (cp outer, see ``data/sharding.py``); inside attention

1. Ulysses exchanges heads within its sp group (``UlyssesAttention``, which wraps this
   module): each rank then holds the whole cp slice of the sequence, ``S/cp`` tokens, for
   its ``H/sp`` heads;
2. this module all-gathers K and V over the cp group (one collective, k and v together):
   ``[B, S/cp, Hkv/sp, D] -> [B, S, Hkv/sp, D]``, in the cp ranks' token order;
3. the local attention runs with the local queries against the keys they may see, by their
   *global* token indices, so every query sees exactly the keys it would on one device:

   * causal (no documents): the gathered K/V are put back in sequence order and each of the
     rank's two chunks attends to the prefix of the sequence that ends with it, with the
     causal diagonal aligned bottom-right (``SDPAAttention.causal_lower_right``: on CUDA in
     bf16/fp16 PyTorch's flash kernel, no mask in memory; elsewhere -- CPU, fp32 -- an
     explicit ``[S/2cp, prefix]`` boolean mask built from the two lengths);
   * packed documents: one call with an explicit boolean mask ``[B, 1, S/cp, S]``, the
     document mask of the full sequence indexed by the queries' and keys' global indices
     (dense, so for moderate lengths; see "Backends").

Why all-gather of K/V and not a ring with a log-sum-exp merge: it is exact by construction
(one softmax over the real keys, no merge of partial results), it is what Llama 3 was trained
with and torchtitan's ``KVAllGatherCP*`` does, and it composes with any mask the local
attention takes -- here a lower-right causal call or a boolean mask. It costs the K/V of the whole
sequence per layer (``S x Hkv/sp x D``, expanded to the q heads where sdpa's kernel does not
take GQA: fp32, or a dense mask) and exposes its communication unless overlapped; a ring
would trade that for cp steps of partial attention and a merge. The all-gather is a
functional collective (``all_gather_single_autograd``): its backward is a reduce-scatter of
the K/V gradients, which sums every rank's contribution into the owner of the tokens.

Compile and selective checkpointing: everything here is plain tensors, ints and functional
collectives, so the trainer's per-block ``torch.compile(fullgraph=True)`` traces the module
and selective activation checkpointing keeps the gathered K/V (``all_gather_into_tensor`` is
in its save list: backward does not gather again) and the attention outputs;
``tests/test_context_parallel.py`` runs both against one process. That is why the causal
path does not use ``torch.nn.attention.bias.causal_lower_right``, as it did at first: its
``CausalBias`` is a tensor subclass made through the legacy tensor constructor, which dynamo
refuses (a graph break, an error under fullgraph), which fails under selective checkpointing's
dispatch mode, and which allocates an uninitialised ``[2, S/2cp, prefix]`` fp32 tensor per call
(up to 8 GiB of address space at 128K tokens over cp = 8). ``causal_lower_right`` runs the
same kernel (CUDA flash, called as ``CausalBias`` calls it) or the same mask (elsewhere). What
is given up: fp32 on CUDA, which ``CausalBias`` ran in the memory-efficient kernel without a
mask, now takes the dense ``[S/2cp, prefix]`` mask -- fp32 is for exactness checks at short
lengths; training runs bf16.

Causal load balance: with a plain split the last cp rank's queries see every key and the
first rank's almost none. ``data.sharding.load_balanced_order`` cuts the sequence into 2cp
chunks and gives rank r chunks r and 2cp-1-r, which evens out the unmasked (q, k) pairs
(``tests/test_context_parallel.py`` counts them). The mask below is built from that order.

Backends (``ops/attention/registry.py`` says which run under cp): a backend with
``causal_lower_right`` (sdpa, flash_attn) attends each chunk to the keys it may see -- the
prefix up to the chunk's end, from the window's start with ``window``, and with packed
documents one call per document segment of the chunks (``ops/attention/per_document.py``,
one custom op that compiled blocks do not retrace), or sdpa's dense mask indexed by global
indices at small lengths. A backend with
``block_mask_for`` (flex) gets one BlockMask over the local queries' and the gathered keys'
global indices, built from block-level ranges (never dense) and cached in the step's mask.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_ulysses.data.sharding import load_balanced_order
from titan_ulysses.distributed.ulysses import UlyssesAttention
from titan_ulysses.ops.attention import DocumentMask, get_backend
from titan_ulysses.ops.attention.masks import visible
from titan_ulysses.ops.attention.per_document import attention_per_document

_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def all_gather_seq(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """``[B, L, H, D]`` on each of ``cp`` ranks -> ``[B, cp*L, H, D]`` (rank order), autograd-correct."""
    b, l, h, d = x.shape
    gathered = _all_gather(x.contiguous(), 0, group)  # [cp*B, L, H, D], rank-major
    return gathered.reshape(cp, b, l, h, d).permute(1, 0, 2, 3, 4).reshape(b, cp * l, h, d)


def cp_mask(attention_mask, cp_rank: int, cp: int, local_len: int, device, window: int = 0) -> torch.Tensor:
    """The boolean mask ``[B or 1, 1, local_len, cp*local_len]`` of this cp rank's queries against
    the gathered keys: causal (and windowed) by global index, and within documents when
    ``attention_mask`` (sdpa's mask of the padded sequence, with its dense ``[B, 1, S, S]``) is given."""
    order = load_balanced_order(cp * local_len, cp, device)  # global index of every gathered key
    q_index = order.view(cp, local_len)[cp_rank]
    band = visible(q_index, order, window)[None, None]
    if attention_mask is None:
        return band
    dense = attention_mask.dense if isinstance(attention_mask, DocumentMask) else None
    if dense is None or dense.shape[-2:] != (cp * local_len, cp * local_len):
        raise ValueError(
            "cp_mask needs sdpa's dense document mask of the full padded sequence "
            f"([B, 1, {cp * local_len}, {cp * local_len}], ops.attention.build_attention_mask at a small length)"
        )
    return dense[:, :, q_index][:, :, :, order] & band


class ContextParallelAttention(nn.Module):
    """Wraps a local attention ``fn(q, k, v, attention_mask=None, *, scale, window, softcap)``: gathers K/V over cp.

    Inputs ``q: [B, S/cp, Hq, D]``, ``k, v: [B, S/cp, Hkv, D]`` -- this cp rank's slice in the
    load-balanced order (after Ulysses' exchange when sp > 1, which wraps this module).
    ``attention_mask`` is None (causal) or the backend's mask of the full padded sequence.
    """

    def __init__(self, local_attention: nn.Module, cp_mesh: DeviceMesh, backend: str | None = None):
        super().__init__()
        if cp_mesh.ndim != 1:
            raise ValueError(f"ContextParallelAttention needs a 1-D cp mesh, got {cp_mesh.ndim} dims")
        if backend is not None and not get_backend(backend).cp:
            raise NotImplementedError(f"context_parallel_degree > 1 is not implemented for attn_backend {backend!r}")
        if not (hasattr(local_attention, "causal_lower_right") or hasattr(local_attention, "block_mask_for")):
            raise NotImplementedError(
                f"context_parallel_degree > 1 needs a local attention with causal_lower_right or block_mask_for, "
                f"not {type(local_attention).__name__}; use model.attn_backend 'sdpa', 'flex' or 'flash_attn'"
            )
        self.local_attention = local_attention
        self.cp = cp_mesh.size()
        self.cp_rank = cp_mesh.get_local_rank()
        self.group = cp_mesh.get_group()

    def forward(self, q, k, v, attention_mask=None, *, scale=None, window=0, softcap=0.0, sinks=None):
        kw = dict(scale=scale, window=window, softcap=softcap, **({} if sinks is None else {"sinks": sinks}))
        if self.cp == 1:
            return self.local_attention(q, k, v, attention_mask, **kw)
        if sinks is not None and not (attention_mask is None or getattr(attention_mask, "dense", None) is not None):
            raise ValueError("attention sinks under context parallelism need unpacked sequences or a dense mask; "
                             "set training.packing false")
        local_len, hkv = k.shape[1], k.shape[2]
        kv = all_gather_seq(torch.cat([k, v], dim=2), self.group, self.cp)  # [B, S, 2 Hkv, D], cp ranks' order
        order = load_balanced_order(self.cp * local_len, self.cp, q.device)
        if hasattr(self.local_attention, "block_mask_for"):  # flex: one call, a BlockMask by global indices
            k, v = kv.split(hkv, dim=2)
            q_index = order.view(self.cp, local_len)[self.cp_rank]
            mask = self.local_attention.block_mask_for(attention_mask, q_index, order, window)
            return self.local_attention.attend(q, k, v, mask, scale=scale, softcap=softcap)
        if isinstance(attention_mask, DocumentMask) and attention_mask.dense is not None:
            k, v = kv.split(hkv, dim=2)  # small lengths: one call, the dense mask by global indices
            mask = cp_mask(attention_mask, self.cp_rank, self.cp, local_len, q.device, window)
            return self.local_attention(q, k, v, mask, scale=scale, softcap=softcap,
                                        **({} if sinks is None else {"sinks": sinks}))
        # keys back in sequence order; my head chunk r and tail chunk 2cp-1-r each see the keys
        # up to their end (from the window's start), the causal diagonal aligned bottom-right
        kv = kv.index_select(1, torch.argsort(order))
        k, v = kv.split(hkv, dim=2)
        chunk = local_len // 2
        if attention_mask is None:
            outs = []
            for i, c in enumerate((self.cp_rank, 2 * self.cp - 1 - self.cp_rank)):
                start, end = c * chunk, (c + 1) * chunk
                ks = max(0, start - window + 1) if window > 0 else 0
                outs.append(self.local_attention.causal_lower_right(
                    q[:, i * chunk:(i + 1) * chunk], k[:, ks:end], v[:, ks:end], **kw))
            return torch.cat(outs, dim=1)  # [B, S/cp, Hq, D]
        # packed documents: one lower-right call per document segment of each chunk, in one op
        runs = torch.tensor(my_query_runs(self.cp, self.cp_rank, local_len), dtype=torch.long)  # [R, 3] on the host
        local = self.local_attention
        return attention_per_document(q, k, v, attention_mask.document_ids, attention_mask.spans_rows, runs,
                                      scale or 0.0, window, softcap, local.backend_name,
                                      getattr(local, "sdpa_backends", "auto"))

    def extra_repr(self) -> str:
        return f"cp={self.cp}, cp_rank={self.cp_rank}"


def my_query_runs(cp: int, cp_rank: int, local_len: int) -> list[tuple[int, int, int]]:
    """Rank ``cp_rank``'s queries (its chunks ``r`` and ``2cp-1-r`` of ``load_balanced_order``) as runs of
    consecutive global indices ``(first local row, global start, global end)``, from the layout alone (no read)."""
    chunk, head, tail = local_len // 2, cp_rank, 2 * cp - 1 - cp_rank
    if tail == head + 1:  # the middle rank's two chunks are one run
        return [(0, head * chunk, (tail + 1) * chunk)]
    return [(0, head * chunk, (head + 1) * chunk), (chunk, tail * chunk, (tail + 1) * chunk)]


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> int:
    """Wrap the ``inner_attention`` of every attention module in ``ContextParallelAttention``.

    Call it before ``apply_ulysses`` (which then wraps this wrapper: heads are exchanged within
    sp first, K/V gathered over cp inside). Returns how many were wrapped.
    """
    wrapped = 0
    for module in list(model.modules()):
        inner = getattr(module, "inner_attention", None)
        if isinstance(inner, UlyssesAttention):
            raise ValueError("apply_cp must run before apply_ulysses (Ulysses wraps context parallelism)")
        if isinstance(inner, nn.Module) and not isinstance(inner, ContextParallelAttention):
            module.inner_attention = ContextParallelAttention(inner, cp_mesh)
            wrapped += 1
    if wrapped == 0:
        raise ValueError("apply_cp found no `inner_attention` module to wrap in the model")
    return wrapped
