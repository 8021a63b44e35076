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


def _kept_bytes(net, tokens) -> int:
    """CPU bytes a forward leaves allocated (what the graph keeps for backward, and the loss), as the
    profiler's allocation events count them: compiled code allocates through the same allocator."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = net(tokens, labels=tokens)  # its graph lives on past the measure
    del loss
    cpu = torch._C._autograd.DeviceType.CPU
    events = prof.profiler.kineto_results.events()
    return sum(e.nbytes() for e in events if e.name() == "[memory]" and e.device_type() == cpu)


def test_compiled_full_offload_keeps_what_eager_does_off_the_device(monkeypatch):
    """Issue 39: compiled full_offload kept more on an H100 than full. A compiled block's unit was stored
    on the block, which forwards attribute writes to the module it wraps: the hooks were never closed and
    packed everything after the first block (the loss, later steps), and the compiled graph's weights went
    to the host and came back as second device copies. Compiled or not, full_offload keeps on the device
    exactly ``full``'s bytes less each block's input, moves nothing but the block inputs, and closes its hooks."""
    import functools

    from titan_ulysses.distributed.compile import apply_compile

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))  # what inductor is given
    args = small_args(n_layers=2)
    tokens = torch.randint(0, args.vocab_size, (2, 64))
    block_input = tokens.numel() * args.dim  # [B, S, D]; the smallest tensor that moves (not the CPU RNG state, 5 KB)
    kept, moved = {}, {}
    for compiled in (False, True):
        torch.manual_seed(0)
        net = Transformer(args)
        net.init_weights()
        apply_ac(net, "full_offload")
        if compiled:
            apply_compile(net)
        offloader = apply_activation_offload(net)
        offloader._to_host = lambda t: torch.empty_like(t, device="meta")  # off the (CPU) device, no backward
        moved[compiled] = _offload_on_cpu(offloader, min_numel=block_input)
        net(tokens, labels=tokens)  # compiles outside the measure
        offloader.offloadable = lambda t: False  # the same model as full: hooks on, nothing moves
        kept[compiled, "full"] = _kept_bytes(net, tokens)
        assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None  # every unit closed
        offloader.offloadable = lambda t: t.numel() >= block_input
        moved[compiled].clear()
        kept[compiled, "full_offload"] = _kept_bytes(net, tokens)
        assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
        assert moved[compiled] == [(*tokens.shape, args.dim)] * args.n_layers  # the block inputs, no weights, no loss tensors
    for compiled in (False, True):
        assert kept[compiled, "full"] - kept[compiled, "full_offload"] == args.n_layers * block_input * 4  # fp32
    # what compile keeps beyond eager (a few bytes the partitioner saves) is the same with or without offload
    assert kept[True, "full_offload"] - kept[False, "full_offload"] == kept[True, "full"] - kept[False, "full"]
