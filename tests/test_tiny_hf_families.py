"""scripts/make_tiny_hf.py writes, for every family, a folder that transformers and this trainer both read alike.

Per family: the config parses into the family's arguments and the weights load with the
logits of transformers' forward, on a sequence longer than every window (the Mistral folder's
32-token window must change its logits); the chat template renders messages (content as a string
or as a list of text parts) exactly as ``apply_chat_template`` does, and the SFT encoder puts
the loss on the assistant turns only.
"""

import dataclasses
import importlib.util
import os

import pytest
import torch

from titan_ulysses.interop.hf_weights import load_hf_weights
from titan_ulysses.data.chat import load_chat_template
from titan_ulysses.data.encode import SFTEncoder
from titan_ulysses.data.tokenizer import build_tokenizer
from titan_ulysses.interop.hf_config import load_hf_args
from titan_ulysses.models.registry import build_model, get_family

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("make_tiny_hf", os.path.join(ROOT, "scripts", "make_tiny_hf.py"))
make_tiny_hf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_tiny_hf)

SEQ = 80
MESSAGES = [
    {"role": "user", "content": [{"type": "text", "text": "What is 53 + 5?"}]},
    {"role": "assistant", "content": "53 + 5 = 58."},
    {"role": "user", "content": "And 2 + 2?"},
    {"role": "assistant", "content": [{"type": "text", "text": "4."}]},
]


@pytest.mark.parametrize("family", sorted(make_tiny_hf.FAMILIES))
def test_tiny_folder_loads_renders_and_masks_like_transformers(family, tmp_path):
    out = str(tmp_path / family)
    assert make_tiny_hf.main([family, out]) == 0
    args = load_hf_args(out)
    assert args.family == family and args.n_layers == 2 and args.dim == 64
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(hf).__name__ == get_family(family).architecture
    hf.config._attn_implementation = "eager"
    model = build_model(args)
    load_hf_weights(model, out)
    # longer than every window (Mistral's 32, Gemma 3's 64), so the windows mask something
    tokens = torch.randint(1, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
        torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)
    if family == "mistral":  # the window is what sets this folder apart: without it the logits move
        assert 0 < args.sliding_window == make_tiny_hf.WINDOW < SEQ
        unwindowed = build_model(dataclasses.replace(args, sliding_window=0))
        load_hf_weights(unwindowed, out)
        with torch.no_grad():
            moved = (unwindowed(tokens) - expected).abs().max().item()
        assert moved > 100 * 1e-5, moved

    reference = transformers.AutoTokenizer.from_pretrained(out)
    tokenizer = build_tokenizer("hf", out)
    template = load_chat_template("", tokenizer, out)
    expected = reference.apply_chat_template(MESSAGES, tokenize=False)
    assert template.render(MESSAGES) == expected
    ids, mask = SFTEncoder(tokenizer, template)(f"{family} row", {"messages": MESSAGES})
    learned = reference.decode([int(i) for i, m in zip(ids, mask) if m])
    # the two assistant answers and each one's end of turn, nothing of the user turns
    assert "53 + 5 = 58." in learned and "4." in learned and "What" not in learned and "2 + 2" not in learned
    assert reference.decode([int(i) for i in ids]) == expected
