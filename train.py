"""`torchrun --nproc-per-node N train.py --config X [--section.key value ...]`: titan_ulysses/train.py (its docstring
says what it does; `python train.py --help`). `torchrun -m titan_ulysses.train` runs the same from any folder."""
from titan_ulysses.train import *  # noqa: F401,F403 (tests call train.main)
from titan_ulysses.train import cli

if __name__ == "__main__":
    cli()
