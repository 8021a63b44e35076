#!/usr/bin/env bash
# Wheels the GPU machine lacks (its python3 has torch 2.11 + CUDA and no internet), into .whl/
# of the repository (ignored by git). Run once here; on the GPU machine, before the suite:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# torchao 0.17 is the release built for torch 2.11; torchdata is pure Python; liger-kernel 0.8.5 and
# cut-cross-entropy 25.1.1 are pure Python over Triton (the GPU machine has triton 3.6), for the loss
# backends liger and cce (perf_loss, peer_1b_16k's Liger column, the perf part's Liger cell).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl torchao==0.17.0 torchdata==0.11.0
python3 -m pip download -q --no-deps -d .whl liger-kernel==0.8.5 cut-cross-entropy==25.1.1
ls -l .whl
