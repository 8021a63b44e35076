"""Activation checkpointing in groups of k layers (``activation_checkpoint.layers_per_checkpoint``).

Forward keeps (under full_offload: sends to the host) only each group's input; backward runs
the group's forward again, then each block's own recompute and backward. The loss and every
gradient must equal a model without checkpointing, and exactly the group inputs travel.
"""

import pytest
import torch

from dist_utils import run_distributed
from model_harness import assert_step_matches, build_pair, make_batch, small_args, trained_like
from test_activation_offload import _offload_on_cpu
from titan_ulysses.distributed.activation_checkpoint import apply_ac
from titan_ulysses.distributed.activation_offload import apply_activation_offload
from titan_ulysses.models.decoder.model import Transformer


def _inner_blocks(net):
    return [block._checkpoint_wrapped_module for block in net.layers.values()]


@pytest.mark.parametrize("mode,k,n_layers", [("full", 2, 4), ("full_offload", 3, 5), ("full_offload", 2, 5)])
def test_groups_match_no_checkpointing(mode, k, n_layers):
    args = small_args(n_layers=n_layers)
    torch.manual_seed(0)
    ref = Transformer(args)
    ref.init_weights()
    trained_like(ref)
    net = Transformer(args)
    net.load_state_dict(ref.state_dict())
    apply_ac(net, mode, layers_per_checkpoint=k)
    sizes = [min(k, n_layers - i) for i in range(0, n_layers, k)]  # the last group is shorter
    if mode == "full_offload":
        offloader = apply_activation_offload(net)
        moved = _offload_on_cpu(offloader, min_numel=2 * 8 * args.dim)
    calls = []
    for block in _inner_blocks(net):
        block.register_forward_hook(lambda m, a, o: calls.append(m))

    tokens = torch.randint(0, args.vocab_size, (2, 8))
    loss = net(tokens, labels=tokens)
    if mode == "full_offload":
        assert moved == [(2, 8, args.dim)] * len(sizes)  # the group inputs, nothing else
        assert offloader._last is not None and len(offloader._last.entries) == 1
    calls.clear()
    loss.backward()
    ref_loss = ref(tokens, labels=tokens)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    # the forwards backward completes: a group's recompute runs each block but its last (PyTorch stops once
    # the last block's input is back; a block's own recompute stops before its output likewise)
    assert len(calls) == sum(s - 1 for s in sizes)
    if mode == "full_offload":  # host and device copies let go (no leak into the next step)
        group = offloader._last
        while group is not None:
            assert group.loaded and all(e.host is None and e.restored is None for e in group.entries)
            group = group.prev
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in net.named_parameters()}
    assert set(grads) == {n for n, _ in ref.named_parameters()}  # the parameter names are those of the model
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")


def _sp2_groups():
    import torch.distributed as dist

    from titan_ulysses.distributed.parallel_dims import ParallelDims
    from titan_ulysses.models.decoder.parallelize import ParallelizeOptions

    pd = ParallelDims(sp=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    args = small_args(n_layers=3)
    options = ParallelizeOptions(ac_mode="full_offload", ac_layers_per_checkpoint=2, param_dtype=torch.float32,
                                 ulysses_head_stages=2, ulysses_stage_keep_attention=False)
    ref, model = build_pair(args, pd, options, trained=True)
    inputs, labels = make_batch(0, 2, 13, args.vocab_size)
    assert_step_matches(ref, model, pd, inputs, labels)


def test_groups_under_fsdp_ulysses_and_head_stages_match_one_process():
    """sp=2 (FSDP over the two ranks, head-staged Ulysses): a group of two blocks and a last group of one."""
    run_distributed(_sp2_groups, 2)


def test_groups_need_full_checkpointing():
    from titan_ulysses.config.manager import ConfigError, load_config
    from titan_ulysses.preflight import validate

    message = ("activation_checkpoint.layers_per_checkpoint 2 needs activation_checkpoint.mode full or full_offload, "
               "not 'selective'; set layers_per_checkpoint 1 or mode full_offload")
    config = load_config(["--config", "train_configs/debug_model.toml", "--activation_checkpoint.mode", "selective",
                          "--activation_checkpoint.layers_per_checkpoint", "2"])
    with pytest.raises(ConfigError) as refused:
        validate(config, 2)  # before any process group
    assert str(refused.value) == message
    with pytest.raises(ValueError, match="layers_per_checkpoint 2 needs"):  # and a direct caller of apply_ac
        apply_ac(Transformer(small_args()), "selective", layers_per_checkpoint=2)

