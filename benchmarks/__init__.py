"""Performance and limits cases of the GPU suite (run by ``scripts/gpu_suite.py``; they print and
record what they measured and on which device), and what the suite's parts share."""
