"""Hugging Face in and out: config.json, tensors, tokenizers, datasets, the Hub, export (transformers and peft formats)."""
