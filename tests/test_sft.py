"""SFT: chat templates render as transformers renders them, the loss covers exactly the
completion / assistant tokens, and a model learns a fixed completion only when the loss
leaves the (random) prompts out."""

import json

import numpy as np
import pytest
import torch

from titan_ulysses.config.manager import load_config
from titan_ulysses.data.build import build_dataset
from titan_ulysses.data.chat import CHATML_TEMPLATE, load_chat_template
from titan_ulysses.data.encode import SFTEncoder
from titan_ulysses.data.tokenizer import ByteTokenizer
from titan_ulysses.models.decoder.model import Transformer
from titan_ulysses.models.flavors import get_flavor
from titan_ulysses.ops.attention import build_attention_mask
from titan_ulysses.ops.loss import IGNORE_INDEX

CHATML_WITH_SYSTEM = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris, of course."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]


class HFTokenizer:
    """A tokenizer.json tokenizer behind this project's encode(text, bos, eos) interface."""

    def __init__(self, folder):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(f"{folder}/tokenizer.json")
        self.bos_id, self.eos_id = self.tok.token_to_id("<s>"), self.tok.token_to_id("</s>")
        self.pad_id, self.vocab_size = self.eos_id, self.tok.get_vocab_size()

    def encode(self, text, bos=True, eos=True):
        return [self.bos_id] * bos + self.tok.encode(text, add_special_tokens=False).ids + [self.eos_id] * eos

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=False)


def hf_tokenizer_folder(tmp_path, template):
    """A byte-level BPE trained on a few sentences, saved the Hugging Face way with a chat template."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [m["content"] for m in CONVERSATION] * 20 + ["user assistant system You are helpful."] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = template
    fast.save_pretrained(str(tmp_path))
    return str(tmp_path)


def masked_runs(ids, mask, decode):
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(decode(current))
            current = []
    return runs + ([decode(current)] if current else [])


@pytest.mark.parametrize("template, turn_end", [(CHATML_WITH_SYSTEM, "<|im_end|>\n"), (LLAMA3_LIKE, "<|eot_id|>")],
                         ids=["chatml-system", "llama3-like"])
def test_chat_template_ids_equal_transformers_and_mask_is_the_assistant_turns(tmp_path, template, turn_end):
    from transformers import AutoTokenizer

    folder = hf_tokenizer_folder(tmp_path, template)
    tokenizer = HFTokenizer(folder)
    chat = load_chat_template("", tokenizer, folder)  # the template saved beside the tokenizer
    assert chat.origin.endswith(("chat_template.jinja", "tokenizer_config.json"))
    ids, mask = SFTEncoder(tokenizer, chat)("row", {"messages": CONVERSATION})
    expected = AutoTokenizer.from_pretrained(folder).apply_chat_template(CONVERSATION, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert ids.tolist() == list(expected)
    assert masked_runs(ids, mask, tokenizer.decode) == ["Paris, of course." + turn_end, "Rome." + turn_end]
    # conversational prompt/completion: only the completion's assistant turn carries loss
    ids2, mask2 = SFTEncoder(tokenizer, chat)("row", {"prompt": CONVERSATION[:3], "completion": CONVERSATION[3:]})
    assert ids2.tolist() == ids.tolist()
    assert masked_runs(ids2, mask2, tokenizer.decode) == ["Rome." + turn_end]


def test_prompt_completion_and_chatml_fallback_with_the_byte_tokenizer():
    tok = ByteTokenizer()
    chat = load_chat_template("", tok, "")
    assert chat.source == CHATML_TEMPLATE
    ids, mask = SFTEncoder(tok, chat)("row", {"prompt": "Q?", "completion": " A."})
    assert ids == [tok.bos_id, *b"Q? A.", tok.eos_id] and mask == [0, 0, 0, 1, 1, 1, 1]
    ids, mask = SFTEncoder(tok, chat)("row", {"messages": CONVERSATION[:2]})
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\nWhat is") and text.endswith("Paris, of course.<|im_end|>\n")
    assert masked_runs(ids, mask, tok.decode) == ["Paris, of course.<|im_end|>\n"]


def write_rows(path, n, seed=0):
    """Random prompts ending in '?', and always the same completion."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = "".join(rng.choice(list("abcdefghijklmnop"), int(rng.integers(4, 12)))) + "?"
            f.write(json.dumps({"prompt": prompt, "completion": " ok!"}) + "\n")


def sft_dataset(path, *args, seq_len=64):
    config = load_config(["--training.dataset", "sft", "--training.dataset_path", str(path),
                          "--training.seq_len", str(seq_len), *args])
    return build_dataset("sft", str(path), ByteTokenizer(), config, 0)


def test_packed_sft_windows(tmp_path):
    write_rows(tmp_path / "d.jsonl", 50)
    ds = sft_dataset(tmp_path / "d.jsonl")
    assert ds.packed and ds.stats["samples"] == 50 and ds.stats["truncated"] == 0
    seen = 0
    for i in range(len(ds)):
        item = ds[i]
        docs = item["document_ids"]
        n_docs = int(docs.max()) + 1
        seen += n_docs
        for d in range(n_docs):
            rows = (docs == d).nonzero().flatten()
            assert item["positions"][rows].tolist() == list(range(len(rows)))  # restart per sample
            targets = item["labels"][rows]
            assert ByteTokenizer().decode(targets[targets != IGNORE_INDEX].tolist()) == " ok!"
            assert targets[-1] == IGNORE_INDEX  # EOS is the last label; nothing crosses samples
    assert seen == 50
    with_prompt = sft_dataset(tmp_path / "d.jsonl", "--training.include_prompt_loss", "true")[0]
    assert (with_prompt["labels"] != IGNORE_INDEX).sum() > (ds[0]["labels"] != IGNORE_INDEX).sum()


def test_overlong_samples_truncate_or_drop(tmp_path):
    write_rows(tmp_path / "d.jsonl", 30)
    truncated = sft_dataset(tmp_path / "d.jsonl", "--training.overlong_samples", "truncate", seq_len=14)
    dropped = sft_dataset(tmp_path / "d.jsonl", "--training.overlong_samples", "drop", seq_len=14)
    lengths = truncated.store.lengths()
    assert truncated.stats["truncated"] == int((lengths > 14).sum()) > 0
    assert dropped.stats["dropped"] == int((lengths > 14).sum()) and dropped.stats["samples"] == int((lengths <= 14).sum())
    assert sum(int(truncated[i]["truncated"]) for i in range(len(truncated))) == truncated.stats["truncated"]


def _train(ds, steps=30, seed=0):
    """A one-layer model trained on packed windows with the dense document mask; the last losses."""
    torch.manual_seed(seed)
    args = get_flavor("debugmodel", dim=64, n_layers=1, n_heads=4, n_kv_heads=4, ffn_hidden_dim=128)
    model = Transformer(args)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        batch = [ds[step * 4 + j] for j in range(4)]
        stack = {k: torch.stack([b[k] for b in batch]) for k in ("input", "labels", "document_ids", "positions")}
        mask = build_attention_mask("sdpa", stack["document_ids"])
        loss = model(stack["input"], positions=stack["positions"], attention_mask=mask, labels=stack["labels"])
        loss = loss / (stack["labels"] != IGNORE_INDEX).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return float(np.mean(losses[-5:]))


def test_completion_only_loss_learns_the_fixed_completion_and_prompt_loss_cannot(tmp_path):
    write_rows(tmp_path / "d.jsonl", 400)
    completion_only = _train(sft_dataset(tmp_path / "d.jsonl"))
    with_prompts = _train(sft_dataset(tmp_path / "d.jsonl", "--training.include_prompt_loss", "true"))
    assert completion_only < 0.1, completion_only
    assert with_prompts > 1.0, with_prompts  # random prompt letters: about log(16) nats each


def test_parquet_rows_of_messages_and_prompt_completion(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"messages": [CONVERSATION[:2], CONVERSATION]}), tmp_path / "chat.parquet")
    ds = sft_dataset(tmp_path / "chat.parquet", seq_len=512)
    assert ds.stats["samples"] == 2 and int(ds.store.mask.sum()) == 2 * len("Paris, of course.<|im_end|>\n") + len("Rome.<|im_end|>\n")
    pq.write_table(pa.table({"prompt": ["Q?"], "answer": ["A"]}), tmp_path / "bad.parquet")
    with pytest.raises(Exception, match=r"bad.parquet row 1: field 'completion' is missing"):
        sft_dataset(tmp_path / "bad.parquet")
