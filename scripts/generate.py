"""`titan-generate` when installed: titan_ulysses/tools/generate.py (`python scripts/generate.py --help`)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package
from titan_ulysses.tools.generate import *  # noqa: E402,F401,F403 (tests import the script's names)
from titan_ulysses.tools.generate import cli  # noqa: E402

if __name__ == "__main__":
    cli()
