import os
import sys

# make `tests` helpers importable in spawned workers and in pytest alike
sys.path.insert(0, os.path.dirname(__file__))
