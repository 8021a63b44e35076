"""Build a reference model and its parallelized twin, and step both on the same global batch."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from dist_utils import assert_close

from titan_ulysses.data.sharding import shard_batch
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.utils import load_full_state_dict
from titan_ulysses.step import forward_backward
from titan_ulysses.models.registry import build_model
from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.models.decoder.model import Transformer
from titan_ulysses.models.decoder.parallelize import ParallelizeOptions, parallelize_decoder
from titan_ulysses.models.flavors import get_flavor
from titan_ulysses.ops.loss import IGNORE_INDEX, cross_entropy_sum

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


RUNTIME_FIELDS = ("attn_backend", "sdpa_backends", "mlp_tile_size", "loss_backend", "loss_chunk_size")


def split_overrides(overrides: dict) -> tuple[dict, ComputeOptions]:
    """(model argument overrides, ComputeOptions from the runtime ones) of one mixed dict."""
    compute = {k: v for k, v in overrides.items() if k in RUNTIME_FIELDS}
    return {k: v for k, v in overrides.items() if k not in RUNTIME_FIELDS}, ComputeOptions(**compute)


def small_args(**overrides):
    base = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden_dim=128)
    base.update(overrides)
    return get_flavor("debugmodel", **base)


def clean_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def trained_like(model: Transformer, seed: int = 0) -> None:
    """Weights far from the init, as training leaves them (like hf_fixtures.randomize): sharp
    attention (q/k 0.3), non-unit norms, larger projections, so that a mask leak or a
    permutation moves the loss far above the tolerance (at init a leak is ~7e-6)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
        elif ".wq." in name or ".wk." in name:
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.1 * torch.randn(p.shape, generator=g))


def build_pair(args, parallel_dims: ParallelDims, options: ParallelizeOptions, compute: ComputeOptions | None = None,
               trained: bool = False):
    """The reference model and a parallelized copy with identical weights (both computing as ``compute``
    says; ``trained``: trained_like)."""
    torch.manual_seed(0)
    ref = Transformer(args, compute)
    ref.init_weights()
    if trained:
        trained_like(ref)
    return ref, parallel_copy(args, ref.state_dict(), parallel_dims, options, compute)


def parallel_copy(args, state: dict, parallel_dims: ParallelDims, options: ParallelizeOptions,
                  compute: ComputeOptions | None = None):
    """``args``' model (its family's decoder) built on meta, parallelized over ``parallel_dims`` and loaded
    with the full ``state``."""
    with torch.device("meta"):
        model = build_model(args, compute)
    parallelize_decoder(model, parallel_dims, options)
    model.to_empty(device="cpu")
    model.init_buffers()
    load_full_state_dict(model, state)
    return model


def parallel_from_hf(folder: str, parallel_dims: ParallelDims, options: ParallelizeOptions):
    """A Hugging Face folder's model, parallelized over ``parallel_dims`` and loaded by ``load_hf_weights``
    over parameters first filled with NaN, so a tensor the load misses on any rank shows."""
    from titan_ulysses.interop.hf_config import load_hf_args
    from titan_ulysses.interop.hf_weights import load_hf_weights

    with torch.device("meta"):
        model = build_model(load_hf_args(folder))
    parallelize_decoder(model, parallel_dims, options)
    model.to_empty(device="cpu")
    model.init_buffers()
    with torch.no_grad():  # garbage that the load must overwrite everywhere
        for p in model.parameters():
            p.fill_(float("nan"))
    load_hf_weights(model, folder)
    return model


def make_batch(step: int, global_batch: int, seq_len: int, vocab: int):
    """A deterministic global batch; some labels ignored so ranks hold uneven token counts."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    drop = torch.rand(global_batch, seq_len, generator=g) < 0.3
    labels[drop] = IGNORE_INDEX
    labels[0, : seq_len // 2] = IGNORE_INDEX  # one sample mostly ignored: per-rank means would differ
    return inputs, labels


def reference_step(ref: Transformer, inputs, labels, microbatches: int = 1):
    """Single-device mean loss over all tokens of the batch; gradients accumulate in ``ref``."""
    n_tokens = (labels != IGNORE_INDEX).sum()
    total = 0.0
    for mb_in, mb_lab in zip(inputs.chunk(microbatches), labels.chunk(microbatches)):
        loss = cross_entropy_sum(ref(mb_in), mb_lab) / n_tokens
        loss.backward()
        total += loss.detach()
    return total


@contextlib.contextmanager
def logits_kept(model, kept: list):
    """While open, each forward of ``model`` also appends its logits (detached, this rank's tokens)
    to ``kept``; the loss and its gradients still come from the model's own ``head``."""
    head = model.head

    def keeping(h, weight, labels=None):
        with torch.no_grad():
            kept.append(head(h.detach(), weight.detach()))  # [B, S/P, vocab]
        return head(h, weight, labels)

    model.head = keeping  # an instance attribute over the class's method
    try:
        yield kept
    finally:
        del model.head


def parallel_step(model, pd: ParallelDims, inputs, labels, microbatches: int = 1):
    """This rank's share of the global batch, sharded over dp then cp x sp, through the trainer's own
    ``forward_backward``; returns (global loss, logits).

    Logits are in this rank's token order (``shard_batch(...).index``: load-balanced with cp).
    """
    dp, dp_rank = pd.get_mesh("dp").size(), pd.get_mesh("dp").get_local_rank()
    sp, sp_rank = pd.get_mesh("sp").size(), pd.get_mesh("sp").get_local_rank()
    cp, cp_rank = pd.get_mesh("cp").size(), pd.get_mesh("cp").get_local_rank()
    local_in, local_lab = inputs.chunk(dp)[dp_rank], labels.chunk(dp)[dp_rank]
    mbs = [
        shard_batch(i, lab, sp_rank, sp, cp_rank=cp_rank, cp=cp)
        for i, lab in zip(local_in.chunk(microbatches), local_lab.chunk(microbatches))
    ]
    with logits_kept(model, []) as logits:
        loss = forward_backward(model, mbs, pd.get_mesh("loss")).loss
    return loss, logits


def assert_step_matches(ref: Transformer, model, pd: ParallelDims, inputs, labels) -> None:
    """One step of ``model`` over ``pd`` gives the reference's loss and every parameter's gradient."""
    ref_loss = reference_step(ref, inputs, labels)
    loss, _ = parallel_step(model, pd, inputs, labels)
    assert_close(loss.float(), ref_loss.float(), "loss")
    ref_params = dict(ref.named_parameters())
    grads = {clean_name(n): full(p.grad) for n, p in model.named_parameters()}
    assert grads.keys() == ref_params.keys()
    for name, g in grads.items():
        assert_close(g, ref_params[name].grad, f"grad {name}")


def assert_blocks_match(model: Transformer, sp_mesh, reference, candidate, candidate_params, what: str,
                        input_scale: float = 1.0) -> None:
    """One block's forward and backward on this rank's slice of a random batch: ``candidate`` (whose
    parameters are ``candidate_params``, e.g. under a compiled wrapper) gives ``reference``'s output,
    input gradient and every parameter gradient."""
    tokens = torch.randint(0, model.args.vocab_size, (2, 16))
    batch = shard_batch(tokens, tokens, sp_mesh.get_local_rank(), sp_mesh.size())
    x = model.tok_embeddings(batch.tokens).detach() * input_scale  # [B, S/sp, D]
    rope = model.rope(batch.positions)
    grad = torch.randn_like(x)
    outs = []
    for block, params in ((reference, reference), (candidate, candidate_params)):
        xi = x.clone().requires_grad_()
        out = block(xi, rope)
        out.backward(grad)
        outs.append((out.detach(), xi.grad, {n: p.grad for n, p in params.named_parameters()}))
    (r_out, r_dx, r_grads), (c_out, c_dx, c_grads) = outs
    assert_close(c_out, r_out, f"{what} output", rtol=1e-4, atol=1e-5)
    assert_close(c_dx, r_dx, f"{what} input grad", rtol=1e-4, atol=1e-5)
    for name, g in r_grads.items():
        assert_close(c_grads[name], g, f"{what} grad {name}", rtol=1e-4, atol=1e-5)


def assert_params_match(model, ref_params: dict, lr: float, steps: int) -> None:
    """Parameters after ``steps`` optimizer steps equal the reference's.

    Adam turns 1e-10 noise on a near-zero gradient into a visible step, so parameters are
    held to 1% of one update (lr): a missed, doubled or misrouted update is 100x that.
    """
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            full(p.detach()), ref_params[clean_name(name)].detach(), rtol=1e-5, atol=lr * 1e-2,
            msg=lambda m: f"param {name} after {steps} steps: {m}",
        )
