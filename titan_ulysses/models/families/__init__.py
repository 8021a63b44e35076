"""Importing this package registers every family (one module each)."""

from titan_ulysses.models.families import gemma, glm, llama, mistral, phi3, qwen  # noqa: F401
