"""Start-up time and peak memory of training on a large local corpus, cold and warm cache;
or, with ``--prefetch``, the step line's data_wait with and without the prefetch thread.

    python scripts/bench_data.py --corpus /tmp/corpus300 --mb 300 --nproc 2 --sp 2
    python scripts/bench_data.py --prefetch --seq-len 16384 --steps 6

``--prefetch``: the same passkey run (debugmodel, float32, one process) with
``training.prefetch_batches`` 0 (each step's batches read when the step starts) and 2 (read
by a thread while the previous steps train); it prints the device and, for each, the mean
data_wait per step (metrics.jsonl, every step logged, the first step left out: start-up)
and the mean step time.

Writes a synthetic ``.jsonl`` corpus of about ``--mb`` MB (long documents of random words,
made once and kept), removes its token cache, then launches the same one-step training run
twice with torchrun (``training.dataset = "text"``, the byte tokenizer): the first run
tokenizes the corpus (its ranks share the work), the second finds the cache. For each run it
prints the seconds from launch to the first step's line and the peak resident memory of the
largest process of that run (``RUSAGE_CHILDREN`` of a wrapper: every rank, and torchrun).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_corpus(folder: str, mb: int, seed: int = 0) -> str:
    path = os.path.join(folder, "corpus.jsonl")
    if os.path.isfile(path) and os.path.getsize(path) >= mb * 2**20 * 0.99:
        return path
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, int(rng.integers(1, 10)))) for _ in range(20000)]
    zipf = 1.0 / np.arange(1, len(words) + 1)
    zipf /= zipf.sum()
    written = 0
    with open(path + ".tmp", "w") as f:
        while written < mb * 2**20:
            n_words = int(rng.integers(300, 12000))  # ~2 KB to ~70 KB per document
            text = " ".join(words[i] for i in rng.choice(len(words), n_words, p=zipf))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)
    os.replace(path + ".tmp", path)
    return path


def run_once(corpus: str, nproc: int, sp: int, seq_len: int, dump: str) -> tuple[float, float, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "train.py", "--training.dataset", "text", "--training.dataset_path", corpus,
           "--training.seq_len", str(seq_len), "--parallelism.ulysses_degree", str(sp),
           "--training.steps", "1", "--training.mixed_precision_param", "float32",
           "--job.dump_folder", dump]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_step, lines = None, []
    for line in proc.stdout:
        lines.append(line.rstrip())
        if first_step is None and line.startswith("step     1"):
            first_step = time.perf_counter() - start
    proc.wait()
    if proc.returncode != 0:
        raise SystemExit("run failed:\n" + "\n".join(lines[-20:]))
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB
    return first_step, peak, "torchrun " + " ".join(cmd[3:])


def stream_waits(ds, batch: int, ahead: int, steps: int = 5) -> list[float]:
    import torch

    from titan_ulysses.data.loader import build_dataloader
    from titan_ulysses.data.microbatches import StepBatches
    from titan_ulysses.data.prefetch import StepStream

    loader = build_dataloader(ds, global_batch_size=batch, local_batch_size=1, dp_rank=0, dp_size=1)
    stream = StepStream(loader, StepBatches(batch, 0, 1, 0, 1, torch.device("cpu"), False, 0), ahead)
    it, waits = iter(stream), []
    next(it)
    for _ in range(steps):
        time.sleep(0.3)  # a step's compute
        start = time.perf_counter()
        next(it)
        waits.append(time.perf_counter() - start)
    stream.close()
    return waits


def prefetch_ab(seq_len: int, steps: int, batch: int, dump: str) -> int:
    """data_wait per step at training.prefetch_batches 0 and 2, same run otherwise."""
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "train.py",
            "--config", "debug_model", "--training.dataset", "passkey", "--model.tokenizer", "byte",
            "--training.seq_len", str(seq_len), "--training.local_batch_size", "1",
            "--training.global_batch_size", str(batch), "--training.steps", str(steps),
            "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--checkpoint.enable", "false",
            "--validation.enable", "false", "--parallelism.ulysses_degree", "1"]
    sys.path.insert(0, ROOT)
    from titan_ulysses.data.datasets import PasskeyDataset
    from titan_ulysses.data.tokenizer import ByteTokenizer

    ds = PasskeyDataset(ByteTokenizer(), seq_len, seed=0)
    ds[0]
    start = time.perf_counter()
    for i in range(1, 21):
        ds[i]
    print(f"host: one passkey sample of {seq_len} tokens built in {1e3 * (time.perf_counter() - start) / 20:.2f} ms "
          f"(mean of 20, byte tokenizer)", flush=True)
    for ahead in (0, 2):  # the data path alone: next() of the step stream, the thread given 0.3 s to catch up
        waits = stream_waits(ds, batch, ahead)
        print(f"host: next() of the step stream at prefetch_batches {ahead}: {1e3 * sum(waits) / len(waits):.2f} ms "
              f"(mean of {len(waits)} steps of {batch} samples, no model)", flush=True)
    for ahead in (0, 2):
        folder = os.path.join(dump, f"prefetch{ahead}")
        shutil.rmtree(folder, ignore_errors=True)
        cmd = base + ["--training.prefetch_batches", str(ahead), "--job.dump_folder", folder]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
        device = next((part.split()[1] for line in out.stdout.splitlines() if line.startswith("titan-ulysses:")
                       for part in line.split(", ") if part.startswith("device ")), "?")
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            rows = [r for r in map(json.loads, f) if "data_wait_sec" in r and r.get("step", 0) > 1]
        wait = sum(r["data_wait_sec"] for r in rows) / len(rows)
        step_s = (rows[-1]["elapsed_sec"] - rows[0]["elapsed_sec"]) / max(len(rows) - 1, 1)
        print(f"device {device}  prefetch_batches {ahead}: data_wait {1e3 * wait:.1f} ms/step, "
              f"step {step_s:.2f} s (mean of steps 2-{steps}; {batch} samples of {seq_len} tokens a step)", flush=True)
    print("command: torchrun " + " ".join(base[3:]) + " --training.prefetch_batches {0,2}")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default="/tmp/titan_corpus")
    p.add_argument("--mb", type=int, default=300)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--prefetch", action="store_true", help="data_wait at training.prefetch_batches 0 and 2")
    p.add_argument("--steps", type=int, default=6, help="--prefetch: steps of each run")
    p.add_argument("--batch", type=int, default=4, help="--prefetch: samples per step (microbatches of one)")
    p.add_argument("--one-run", help=argparse.SUPPRESS)  # internal: one run, its own rusage
    args = p.parse_args(argv)
    if args.prefetch:
        return prefetch_ab(args.seq_len, args.steps, args.batch, os.path.join(args.corpus, "prefetch_runs"))
    if args.one_run:
        print(json.dumps(run_once(args.corpus, args.nproc, args.sp, args.seq_len, args.one_run)))
        return 0
    t0 = time.perf_counter()
    corpus = make_corpus(args.corpus, args.mb)
    print(f"corpus {corpus}: {os.path.getsize(corpus) / 2**20:.0f} MB ({time.perf_counter() - t0:.0f}s to make)", flush=True)
    shutil.rmtree(os.path.join(args.corpus, ".titan_cache"), ignore_errors=True)
    dump = os.path.join(args.corpus, "outputs")
    for label in ("first run (tokenizes)", "second run (cached)"):
        shutil.rmtree(dump, ignore_errors=True)
        out = subprocess.run([sys.executable, __file__, "--corpus", corpus, "--nproc", str(args.nproc), "--sp",
                              str(args.sp), "--seq-len", str(args.seq_len), "--one-run", dump],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
        seconds, peak, cmd = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{label}: first step after {seconds:.1f}s; peak RSS of the largest process {peak:.2f} GiB", flush=True)
    print(f"command: {cmd}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
