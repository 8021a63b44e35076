"""Distributed checkpoints (DCP) and Hugging Face export."""
