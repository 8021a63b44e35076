"""Adapters that bring titan-ulysses into other training stacks (optional extras)."""
