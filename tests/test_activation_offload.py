"""full_offload: each block's saved input goes to host memory and comes back, one block ahead.

On CPU there is no host memory to move to, so these tests declare CPU tensors offloadable:
the copies, the per-block grouping and the prefetch order then run as they do on CUDA
(where the copies are issued on a side stream), and the gradients must not change.
"""

import torch
from torch import nn

from model_harness import small_args
from titan_ulysses.distributed.activation_checkpoint import apply_ac
from titan_ulysses.distributed.activation_offload import apply_activation_offload
from titan_ulysses.models.decoder.model import Transformer


def _offload_on_cpu(offloader, min_numel):
    """Treat CPU tensors of at least ``min_numel`` elements as device tensors; record what moves."""
    moved = []
    to_host = offloader._to_host

    def recording_to_host(t):
        host = to_host(t)
        assert host.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()  # a real copy
        moved.append(tuple(t.shape))
        return host

    offloader.offloadable = lambda t: t.numel() >= min_numel
    offloader._to_host = recording_to_host
    return moved


def test_block_inputs_travel_to_host_and_back_one_block_ahead():
    args = small_args(n_layers=4)
    torch.manual_seed(0)
    ref = Transformer(args)
    ref.init_weights()
    net = Transformer(args)
    net.load_state_dict(ref.state_dict())
    apply_ac(net, "full_offload")
    offloader = apply_activation_offload(net)
    moved = _offload_on_cpu(offloader, min_numel=2 * 8 * args.dim)
    groups = []
    for block in net.layers.children():  # runs after the offloader's pre-hook: its new group
        block.register_forward_pre_hook(lambda m, a: groups.append(offloader._last))

    tokens = torch.randint(0, args.vocab_size, (2, 8))
    loss = net(tokens, labels=tokens)
    assert moved == [(2, 8, args.dim)] * args.n_layers  # each block's input, nothing else
    assert [len(g.entries) for g in groups] == [1] * args.n_layers
    assert not any(g.loaded for g in groups)  # nothing comes back before backward
    loss.backward()
    ref(tokens, labels=tokens).backward()
    # backward met the last block first; every earlier one was already on its way back
    assert [g.loaded for g in groups] == [True] * args.n_layers
    assert [g.prefetched for g in groups] == [True] * (args.n_layers - 1) + [False]
    assert all(e.host is None for g in groups for e in g.entries)  # host buffers released
    # and the device copies too: the offloader keeps its entries until the next forward, and once
    # held every block's restored input (the whole stack of them on the device at the optimizer step)
    assert all(e.restored is None for g in groups for e in g.entries)
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in net.named_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=0, atol=0)


class _Scale(nn.Module):
    def forward(self, x, table):
        return x * table  # saves both x and the table


class _Stack(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): _Scale() for i in range(n)})

    def forward(self, x, table):
        for layer in self.layers.values():
            x = layer(x, table)
        return x


def test_a_tensor_every_block_saves_travels_once():
    net = _Stack(3)
    offloader = apply_activation_offload(net)
    moved = _offload_on_cpu(offloader, min_numel=16)
    table = torch.randn(4, 16, requires_grad=True)
    x = torch.randn(4, 16, requires_grad=True)
    out = net(x, table)
    # block 0 sends x and the table; blocks 1, 2 only their input: the table stays put
    assert moved == [(4, 16)] * 4
    out.sum().backward()
    t, xx = table.detach().requires_grad_(), x.detach().requires_grad_()
    (xx * t * t * t).sum().backward()
    torch.testing.assert_close(table.grad, t.grad)
    torch.testing.assert_close(x.grad, xx.grad)
    # a second forward starts afresh (no entry of the first is reused)
    moved.clear()
    net(x, table).sum().backward()
    assert moved == [(4, 16)] * 4


def test_host_copies_are_pieces_the_pinned_allocator_does_not_round_up():
    """The pinned host allocator rounds each buffer up to a power of two (a 5.75 GiB block input of the
    8B at 6M over sp=8 would take 8 GiB): copies are power-of-two pieces instead, exact to the floor."""
    from titan_ulysses.distributed.host_copy import FLOOR, HostCopy, piece_sizes

    block_input = 753_664 * 4096 * 2  # [S/sp, D] in bf16 at 6,029,312 tokens over sp=8
    sizes = piece_sizes(block_input)
    assert sum(sizes) == block_input and all(s & (s - 1) == 0 and s >= FLOOR for s in sizes)
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    for n in (1, FLOOR - 1, FLOOR, FLOOR + 1, 3 * FLOOR + 5):
        assert 0 <= sum(piece_sizes(n)) - n < FLOOR
    torch.manual_seed(0)
    for t in (torch.randn(3, 1001, 7, dtype=torch.bfloat16), torch.randn(5, 9), torch.randn(8, 6).t()):
        copy = HostCopy(t, pin=False, floor=64)  # a small floor: several pieces, the last one partly used
        assert (copy.whole is None) == t.is_contiguous()
        nbytes = t.numel() * t.element_size()
        assert 0 <= sum(p.numel() for p in copy.pieces) - nbytes < 64 or not t.is_contiguous()
        back = copy.restore(non_blocking=False)
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
        assert copy.pieces == [] and copy.whole is None  # the host memory is let go
