"""Importing this package registers every family (one module each)."""

from titan_ulysses.models.families import gemma, glm, gpt_oss, llama, mistral, mixtral, phi3, qwen, qwen3_moe  # noqa: F401
