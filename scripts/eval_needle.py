"""`titan-eval-needle` when installed: titan_ulysses/tools/eval_needle.py (`python scripts/eval_needle.py --help`)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package
from titan_ulysses.tools.eval_needle import *  # noqa: E402,F401,F403 (tests import the script's names)
from titan_ulysses.tools.eval_needle import cli  # noqa: E402

if __name__ == "__main__":
    cli()
