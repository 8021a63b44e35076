"""torchtitan's own Llama 3 (debug flavor) with the Ulysses adapter equals the model without it.

The reference is torchtitan's model in one process on the full sequence; the twin has the
same weights, runs at sp=2 on two gloo ranks through ``apply_ulysses_to_torchtitan`` and
``prepare_ulysses_inputs``, and must give the same loss and the same gradient for every
parameter (gradients summed over the sp ranks, as FSDP does).
"""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import _build_llama3_layers, _debugmodel  # private, but the release is pinned

from dist_utils import assert_close, run_distributed
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.integrations import torchtitan as tt
from titan_ulysses.ops.loss import IGNORE_INDEX

VOCAB = 2048  # torchtitan's debugmodel


def tt_llama(n_layers=2, n_kv_heads=None, inner="sdpa"):
    """torchtitan's debugmodel config, shortened to ``n_layers``, with ``n_kv_heads`` kv heads."""
    cfg = _debugmodel("flex")
    attn = cfg.layers[0].attention
    layers = _build_llama3_layers(
        n_layers=n_layers, dim=cfg.dim, n_heads=attn.n_heads, n_kv_heads=n_kv_heads,
        hidden_dim=cfg.layers[0].feed_forward.w1.out_features, rope=attn.rope, fuse_qkv=True, attn_backend="flex",
    )
    if inner == "sdpa":  # torchtitan's own SDPA (causal only): flex has no CPU backward
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = dataclasses.replace(cfg, layers=layers)
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    return model


def batch(seq_len, packed):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (2, seq_len + 1), generator=g)
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    labels[0, :3] = IGNORE_INDEX
    positions = None
    if packed:  # row 0: documents of 5, 6 and the rest; row 1: one document
        positions = torch.arange(seq_len).repeat(2, 1)
        positions[0, 5:11] = torch.arange(6)
        positions[0, 11:] = torch.arange(seq_len - 11)
    return inputs, labels, positions


def loss_sum(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def _matches_reference(seq_len, n_kv_heads, backend, packed):
    pd = ParallelDims(sp=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    sp_mesh = pd.get_mesh("sp")
    ref = tt_llama(n_kv_heads=n_kv_heads)
    if backend is not None:  # the reference runs our kernel too, without Ulysses
        for block in ref.layers.values():
            block.attention.inner_attention = tt.TorchtitanLocalAttention(backend)
    model = tt.apply_ulysses_to_torchtitan(copy.deepcopy(ref), sp_mesh, attn_backend=backend)
    inputs, labels, positions = batch(seq_len, packed)
    n_tokens = (labels != IGNORE_INDEX).sum()

    ref_kwargs = {}
    if positions is not None:
        ref_kwargs["positions"] = positions
        ids = tt.document_ids_from_positions(positions)
        ref_kwargs["attention_masks"] = tt.build_attention_mask(backend, ids)
    ref_loss = loss_sum(ref(inputs, **ref_kwargs), labels) / n_tokens
    ref_loss.backward()

    local_inputs, local_labels, extra = tt.prepare_ulysses_inputs(inputs, labels, sp_mesh, positions, backend)
    assert local_inputs.shape[1] == -(-seq_len // 2)  # [B, S_pad/2]
    logits = model(local_inputs, **extra)  # [B, S_pad/2, V]
    if positions is None:  # the adapter supplies global positions itself when none are given
        assert_close(model(local_inputs), logits, "logits without positions", rtol=0, atol=0)
    loss = loss_sum(logits, local_labels) / n_tokens
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    assert_close(total, ref_loss.detach(), "loss")
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        assert_close(p.grad, ref_params[name].grad, f"grad {name}")


@pytest.mark.parametrize(
    "seq_len, n_kv_heads, backend, packed",
    [
        (13, None, None, False),  # torchtitan's own inner attention; S padded to 14
        (16, 1, "sdpa", True),  # one kv head replicated to both ranks; packed documents
    ],
    ids=["torchtitan_sdpa_padded", "ours_sdpa_kv1_packed"],
)
def test_torchtitan_llama_with_ulysses_equals_without(seq_len, n_kv_heads, backend, packed):
    run_distributed(_matches_reference, 2, seq_len, n_kv_heads, backend, packed)


def _trainer_hook_shards_like_prepare():
    """UlyssesTrainer.post_dataloading_process gives each rank its slice and the full mask."""
    pd = ParallelDims(sp=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    sp_mesh = pd.get_mesh("sp")
    model = tt.apply_ulysses_to_torchtitan(tt_llama(), sp_mesh, attn_backend="sdpa")

    class Dims:
        cp_enabled = True

        def get_mesh(self, name):
            assert name == "cp"
            return sp_mesh

    class Fake:
        parallel_dims, model_parts, ntokens_seen = Dims(), [model], 0

    inputs, labels, positions = batch(16, packed=True)
    trainer_cls = tt._trainer_class()
    fake = Fake()
    tokens, local_labels, extra = trainer_cls.post_dataloading_process(
        fake, {"input": inputs, "positions": positions}, labels
    )
    rank = sp_mesh.get_local_rank()
    assert torch.equal(tokens, inputs[:, rank * 8:(rank + 1) * 8])
    assert torch.equal(local_labels, labels[:, rank * 8:(rank + 1) * 8])
    assert torch.equal(extra["positions"], positions[:, rank * 8:(rank + 1) * 8])
    assert extra["attention_masks"].dense.shape == (2, 1, 16, 16)  # the full sequence's mask (sdpa, short: dense)
    assert fake.ntokens_seen == 16


def test_torchtitan_trainer_hook():
    run_distributed(_trainer_hook_shards_like_prepare, 2)


def test_registry_entry_builds_a_ulysses_trainer_config():
    config = tt.llama3_debugmodel_ulysses()
    assert type(config).__qualname__.endswith("UlyssesTrainer.Config")
    assert config.parallelism.context_parallel_degree == 2
    assert config.parallelism.context_parallel_load_balancer is None
    fn = config.model_spec.parallelize_fn
    assert fn.func is tt.parallelize_llama_ulysses and fn.keywords == {"attn_backend": "sdpa"}
    # torchtitan's own command-line loader resolves the module path and the function
    from torchtitan.config import ConfigManager

    loaded = ConfigManager().parse_args(
        ["--module", "titan_ulysses.integrations.torchtitan", "--config", "llama3_debugmodel_ulysses"]
    )
    assert type(loaded).__qualname__.endswith("UlyssesTrainer.Config")


def test_heads_that_cannot_be_split_are_refused_before_any_collective():
    class Mesh:  # apply_ulysses_to_torchtitan checks heads before touching the group
        ndim = 1

        def size(self):
            return 32  # torchtitan's debugmodel has 16 heads (16 over 3 ranks would be split unevenly)

    with pytest.raises(ValueError, match="ulysses_degree 32 is larger than the 16 attention heads"):
        tt.apply_ulysses_to_torchtitan(tt_llama(), Mesh(), attn_backend="sdpa")


def test_our_document_masks_agree_with_torchtitans_flex_masks():
    """Packed documents: our sdpa with masks from positions == torchtitan's own flex path (forward;
    flex has no CPU backward), and differs from plain causal attention, so the masks matter."""
    ref = tt_llama(inner="flex")
    ours = copy.deepcopy(ref)
    for block in ours.layers.values():
        block.attention.inner_attention = tt.TorchtitanLocalAttention("sdpa")
    inputs, _, positions = batch(16, packed=True)
    with torch.no_grad():
        expected = ref(inputs, positions=positions, attention_masks=ref.get_attention_masks(positions=positions))
        mask = tt.build_attention_mask("sdpa", tt.document_ids_from_positions(positions))
        actual = ours(inputs, positions=positions, attention_masks=mask)
        causal_only = ours(inputs, positions=positions)
    assert_close(actual, expected, "logits vs torchtitan flex")
    assert (causal_only - expected).abs().max() > 1e-2
