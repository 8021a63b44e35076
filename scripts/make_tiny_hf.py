"""Write a small random Hugging Face model folder of one family, with a tokenizer and a chat template.

    python scripts/make_tiny_hf.py FAMILY OUT [--layers 2] [--dim 64] [--seed 0]

FAMILY is a ``model_type`` this trainer reads (llama, qwen2, qwen3, mistral with a 32-token
sliding window, phi3, gemma3_text with a 64-token window on its first layer, and the mixtures
of experts qwen3_moe (8 experts, top-2) and mixtral (4 experts, top-2, the 32-token window)). The folder is
what ``save_pretrained`` writes (config.json, model.safetensors) plus a byte-level BPE
``tokenizer.json`` trained on a few sentences, with the family's special tokens and a chat
template in its format (``chat_template.jinja``), so that
``--model.hf_assets_path OUT --model.tokenizer hf`` trains from it on a laptop. The weights
are transformers' own random init: a starting point for trying the pipeline, not a model.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# family -> (config overrides, bos, eos, chat template in the family's turn format)
WINDOW = 32  # the Mistral folder's sliding window, in tokens
_ROLE = "{{ message['content'] if message['content'] is string else message['content'][0]['text'] }}"
FAMILIES = {
    "llama": ({}, "<|begin_of_text|>", "<|eot_id|>",
              "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
              + _ROLE + "<|eot_id|>{% endfor %}"
              "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "qwen2": ({}, None, "<|im_end|>",
              "{% for message in messages %}<|im_start|>{{ message['role'] }}\n" + _ROLE + "<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    # a window shorter than tiny_hf_sft.toml's 128 tokens (Mistral 7B v0.1, Ministral): without it the
    # folder computes what the Llama one does (same shapes, seed and so weights)
    "mistral": ({"sliding_window": WINDOW}, "<s>", "</s>",
                "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]" + _ROLE +
                "[/INST]{% elif message['role'] == 'assistant' %}" + _ROLE + "{{ eos_token }}{% endif %}{% endfor %}"),
    "phi3": ({"pad_token_id": 0}, None, "<|end|>",
             "{% for message in messages %}<|{{ message['role'] }}|>\n" + _ROLE + "<|end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    "gemma3_text": ({"head_dim": 16, "sliding_window": 64, "pad_token_id": 0}, "<bos>", "<end_of_turn>",
                    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
                    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n" + _ROLE +
                    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
}
FAMILIES["qwen3"] = ({"head_dim": 16}, *FAMILIES["qwen2"][1:])
# mixtures of experts, their load-balancing loss on (output_router_logits) as a fine-tune would set it
FAMILIES["qwen3_moe"] = ({"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                          "output_router_logits": True, "router_aux_loss_coef": 0.01}, *FAMILIES["qwen2"][1:])
FAMILIES["mixtral"] = ({"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
                        "output_router_logits": True, "router_aux_loss_coef": 0.01}, *FAMILIES["mistral"][1:])
TEXTS = [
    "The pass key is 12345. Remember it. What is the pass key?",
    "Add 49 and 97: 146. What is 53 + 5? 53 + 5 = 58. You add numbers.",
    "def f(x):\n    return x * 2  # digits 0 1 2 3 4 5 6 7 8 9",
] * 4


def make_tokenizer(out: str, family: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    _, bos, eos, template = FAMILIES[family]
    specials = [t for t in ("<pad>", bos, eos, "<|im_start|>", "<|start_header_id|>", "<|end_header_id|>",
                            "[INST]", "[/INST]", "<|user|>", "<|assistant|>", "<|system|>", "<start_of_turn>")
                if t]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 8, special_tokens=list(dict.fromkeys(specials)),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token="<pad>")
    fast.chat_template = template
    fast.save_pretrained(out)
    return fast


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    if a.layers < 1 or a.dim < 16 or a.dim % 8:
        print("make_tiny_hf: --layers must be >= 1 and --dim a multiple of 8, >= 16", file=sys.stderr)
        return 2
    import torch
    import transformers

    vocab = 512
    tokenizer = make_tokenizer(a.out, a.family, vocab)
    overrides = FAMILIES[a.family][0]
    config = transformers.AutoConfig.for_model(
        a.family, hidden_size=a.dim, intermediate_size=2 * a.dim, num_hidden_layers=a.layers, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        **{"pad_token_id": tokenizer.pad_token_id, **overrides},
        **({"layer_types": ["sliding_attention"] * (a.layers - 1) + ["full_attention"]}
           if a.family == "gemma3_text" else {}))
    torch.manual_seed(a.seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(a.out)
    print(f"wrote {a.out}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          f"parameters, tokenizer of {len(tokenizer)} ids with its chat template")
    return 0


if __name__ == "__main__":
    sys.exit(main())
