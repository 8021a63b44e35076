"""titan-ulysses: Ulysses sequence parallelism for long-context Llama training."""

__version__ = "0.1.0"
