"""The generic decoder's seams (models/decoder/): what a family may replace, and what must not move.

* The feed-forward is built by the family's ``DecoderSpec.feed_forward`` (the mixture of experts
  plugs its MLP there); one that returns statistics beside its output (a router's, for a loss
  pooled over layers) has them summed over layers on the model, with their gradient path,
  eager, under every activation checkpointing mode and compiled.
* Checkpoint names (``layers.0.attention.wq.weight``, ...) and the records Gemma checkpoints
  were written with are unchanged.
* A family is one file under ``models/families/`` and one line in its ``__init__.py``: no other
  library module names a family's ``model_type``.
"""

import ast
import dataclasses
import glob
import json
import os

import pytest
import torch

from model_harness import make_batch, small_args
from titan_ulysses.interop.hf_export import read_model_record
from titan_ulysses.distributed.activation_checkpoint import apply_ac
from titan_ulysses.distributed.compile import apply_compile
from titan_ulysses.models.decoder.feed_forward import FeedForward, dense
from titan_ulysses.models.decoder.model import Transformer
from titan_ulysses.models.decoder.spec import DecoderSpec
from titan_ulysses.interop.hf_config import args_from_hf_config
from titan_ulysses.models.registry import FAMILIES, build_model, get_family
from titan_ulysses.ops.loss import cross_entropy_sum

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "titan_ulysses")


class AuxDense(FeedForward):
    """The dense MLP returning toy statistics beside its output, as a router returns its counts and
    probabilities (a function of the input and the weights)."""

    def forward(self, x):
        out = super().forward(x)
        return out, out.float().pow(2).mean()


class RecordedDense(FeedForward):
    """The same MLP returning its output alone and keeping the auxiliary loss aside, for the reference."""

    losses: list

    def forward(self, x):
        out = super().forward(x)
        self.losses.append(0.05 * out.float().pow(2).mean())
        return out


def _builder(cls):
    def build(layer_id, args, compute):
        return cls(args.dim, args.ffn_hidden_dim, compute.mlp_tile_size)
    return build


def test_feed_forward_is_built_by_the_family_spec():
    args = small_args(n_layers=3)
    calls = []

    def build(layer_id, a, compute):
        calls.append((layer_id, a is args))
        return dense(layer_id, a, compute)

    torch.manual_seed(0)
    model = Transformer(args, spec=DecoderSpec(feed_forward=build))
    assert calls == [(0, True), (1, True), (2, True)]
    torch.manual_seed(0)
    default = Transformer(args)  # the llama family's spec: the same dense MLP, the same names
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in default.named_parameters()]
    model.load_state_dict(default.state_dict())
    tokens = torch.randint(0, args.vocab_size, (2, 9))
    torch.testing.assert_close(model(tokens), default(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["none", "full", "full_groups", "selective", "compile"])
def test_feed_forward_statistics_reach_the_loss_with_their_gradient(mode):
    """Statistics returned through the seam are summed over layers and returned (``return_stats``); a loss
    term made of them has the gradients of the reference that adds the same terms by hand, and they
    differ from the loss alone."""
    args = small_args(n_layers=3)
    torch.manual_seed(0)
    ref = Transformer(args, spec=DecoderSpec(feed_forward=_builder(RecordedDense)))
    ref.init_weights()
    with torch.no_grad():  # far from the init: the aux term's gradient is not small
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model = Transformer(args, spec=DecoderSpec(feed_forward=_builder(AuxDense)))
    model.load_state_dict(ref.state_dict())
    if mode in ("full", "full_groups", "selective"):
        apply_ac(model, "selective" if mode == "selective" else "full", 2 if mode == "full_groups" else 1)
    if mode == "compile":
        apply_compile(model)
    tokens, labels = make_batch(0, 2, 11, args.vocab_size)

    losses = []
    for layer in ref.layers.values():
        layer.feed_forward.losses = losses
    lm = cross_entropy_sum(ref(tokens), labels) / labels.numel()
    lm.backward(retain_graph=True)
    plain = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref.zero_grad()
    assert len(losses) == args.n_layers
    (lm + sum(losses)).backward()

    logits, stats = model(tokens, return_stats=True)
    lm_model = cross_entropy_sum(logits, labels) / labels.numel()
    torch.testing.assert_close(0.05 * stats, sum(losses).detach(), rtol=1e-6, atol=0)
    (lm_model + 0.05 * stats).backward()
    grads = {n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): p.grad
             for n, p in model.named_parameters()}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}")
    w1 = "layers.0.feed_forward.w1.weight"
    assert (plain[w1] - ref.get_parameter(w1).grad).abs().max() > 1e-4  # the aux term moved the gradient


def test_checkpoint_names_are_unchanged():
    """The fully-qualified names existing checkpoints hold, for the Llama block and Gemma's."""
    llama = {k.split(".", 2)[2] for k in Transformer(small_args(n_layers=1, qkv_bias=True, qk_norm=True))
             .state_dict() if k.startswith("layers.0.")}
    assert llama == {"attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
                     "attention.wq.bias", "attention.wk.bias", "attention.wv.bias", "attention.q_norm.weight",
                     "attention.k_norm.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
                     "feed_forward.w3.weight", "attention_norm.weight", "ffn_norm.weight"}
    gemma = build_model(args_from_hf_config(GEMMA3))
    names = set(gemma.state_dict())
    assert {"tok_embeddings.weight", "norm.weight", "layers.1.post_attention_norm.weight",
            "layers.1.post_ffn_norm.weight", "layers.1.attention.q_norm.weight"} <= names
    assert "output.weight" not in names  # tied


GEMMA3 = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
          "sliding_window": 7, "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 24,
          "rope_local_base_freq": 10000.0, "rope_theta": 1e6, "max_position_embeddings": 64}


def test_a_gemma_record_of_before_the_decoder_reads_back(tmp_path):
    """model_args.json as GemmaArgs wrote it (models/gemma/, before models/decoder/) builds the same model."""
    args = args_from_hf_config(GEMMA3)
    record = {k: v for k, v in dataclasses.asdict(args).items()
              if k not in ("layer_types", "local_rope_theta", "local_rope_scaling", "query_pre_attn_scalar",
                           "attn_softcap", "final_softcap")}
    record.update(layer_types=["sliding_attention", "full_attention"], local_rope_theta=10000.0,
                  local_rope_scaling=None, query_pre_attn_scalar=24.0, attn_softcap=0.0, final_softcap=0.0)
    (tmp_path / "model_args.json").write_text(json.dumps({"args": record}))
    back, _ = read_model_record(str(tmp_path))
    assert back == args
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    again = build_model(back)
    again.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 300, (1, 12))
    torch.testing.assert_close(again(tokens), model(tokens), rtol=0, atol=0)
    assert isinstance(again.rope(torch.arange(4)), dict)  # the sliding layer's own RoPE


def _quoted_strings(path: str) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(open(path).read(), path))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_a_family_is_its_file_and_one_line():
    """No library module outside ``models/families/`` names a family's model_type (the default, llama, aside):
    what a family changes lives in its file, registered by one import in ``families/__init__.py``."""
    get_family("llama")  # registers them all
    families = os.path.join(PACKAGE, "models", "families")
    init = os.path.join(families, "__init__.py")
    tree = ast.parse(open(init).read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    for model_type, family in FAMILIES.items():
        module = family.args_from_config.__module__
        assert module.rsplit(".", 1)[1] in imported and os.path.isfile(os.path.join(ROOT, *module.split(".")) + ".py")
    for path in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True):
        if path.startswith(families + os.sep):
            continue
        named = _quoted_strings(path) & (set(FAMILIES) - {"llama"})
        assert not named, f"{os.path.relpath(path, ROOT)} names {sorted(named)}: that belongs in its family's file"

