"""Packed data through the trainer itself on CPU (sdpa with the dense document mask).

* one ``train_step`` at sp=2 over four microbatches of unequal token counts, rows whose
  positions differ, equals every sample run on its own through a plain model: a loss
  normalised per microbatch, a RoPE that took row 0's positions for every row, or sdpa
  attending across samples would each change the loss;
* validation: the held-out loss at sp=2 equals one process's, training losses are the same
  with validation on and off, and a checkpoint saved right after an evaluation is whole.
"""

import json
import os

import numpy as np
import pytest
import torch

from dist_utils import run_distributed
from helpers import run
from titan_ulysses.config.manager import load_config
from titan_ulysses.models.decoder.model import Transformer
from titan_ulysses.ops.loss import IGNORE_INDEX


def write_sft(path, n=48, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = "".join(rng.choice(list("abcdefgh"), int(rng.integers(2, 30))))
            completion = "".join(rng.choice(list("xyz "), int(rng.integers(1, 25))))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")


def sft_args(path, seq_len=64):
    return ["--training.dataset", "sft", "--training.dataset_path", path, "--training.seq_len", str(seq_len),
            "--training.mixed_precision_param", "float32", "--model.flavor", "debugmodel"]


def _step_equals_samples_alone(path):
    from titan_ulysses.trainer import Trainer

    argv = sft_args(path) + ["--parallelism.ulysses_degree", "2", "--training.local_batch_size", "2",
                             "--training.global_batch_size", "8", "--training.steps", "1"]
    trainer = Trainer(load_config(argv))
    assert trainer.use_doc_mask and trainer.accumulation_steps == 4
    items = [trainer.data.dataset[i] for i in range(8)]  # step 1 reads global samples 0..7
    counts = [sum(int((it["labels"] != IGNORE_INDEX).sum()) for it in items[k:k + 2]) for k in range(0, 8, 2)]
    assert len(set(counts)) > 1, f"microbatch token counts should differ: {counts}"
    assert any(not torch.equal(items[k]["positions"], items[k + 1]["positions"]) for k in range(0, 8, 2))

    ref = Transformer(trainer.args)  # the trainer's initial weights (trainer.init_weights on CPU)
    torch.manual_seed(trainer.config.training.seed)
    ref.init_weights()
    total, n_tokens = torch.zeros((), dtype=torch.float64), sum(counts)
    with torch.no_grad():
        for it in items:
            for d in it["document_ids"].unique():
                if d < 0:
                    continue
                cols = (it["document_ids"] == d).nonzero().flatten()
                total += ref(it["input"][cols][None], labels=it["labels"][cols][None]).double()
    out = trainer.train_step(iter(trainer.dataloader))
    expected = (total / n_tokens).item()
    assert out["loss"] == pytest.approx(expected, rel=1e-5), (out["loss"], expected)
    assert out["loss_tokens"] == n_tokens
    padding = sum(int((it["document_ids"] == -1).sum()) for it in items) / (8 * 64)
    assert out["padding"] == pytest.approx(padding) and out["truncated"] == 0


def test_packed_train_step_with_accumulation_equals_each_sample_alone(tmp_path):
    path = str(tmp_path / "sft.jsonl")
    write_sft(path)
    run_distributed(_step_equals_samples_alone, 2, path)


def split(metrics):
    train = {m["step"]: m["loss"] for m in metrics if "loss" in m}
    val = {m["step"]: m["validation_loss"] for m in metrics if "validation_loss" in m}
    return train, val


def test_validation_at_sp2_equals_one_process_and_does_not_change_training(tmp_path):
    path, held_out = str(tmp_path / "sft.jsonl"), str(tmp_path / "val.jsonl")
    write_sft(path)
    write_sft(held_out, n=16, seed=1)
    common = sft_args(path) + ["--training.steps", "2", "--training.local_batch_size", "2",
                               "--training.global_batch_size", "4"]
    val = ["--validation.enable", "true", "--validation.dataset_path", held_out, "--validation.freq", "1",
           "--validation.steps", "2"]
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    one_train, one_val = split(run(1, common + val, tmp_path, "one"))
    sp2_train, sp2_val = split(run(2, common + val + ckpt + ["--parallelism.ulysses_degree", "2"], tmp_path, "sp2"))
    off_train, off_val = split(run(2, common + ["--parallelism.ulysses_degree", "2"], tmp_path, "off"))
    assert sorted(one_val) == sorted(sp2_val) == [1, 2] and not off_val
    for step in (1, 2):
        assert sp2_val[step] == pytest.approx(one_val[step], rel=1e-5)
        assert sp2_train[step] == pytest.approx(one_train[step], rel=1e-5)
        assert sp2_train[step] == off_train[step]  # validation leaves training untouched
    # the save right after the step-2 evaluation is complete
    assert os.path.isfile(tmp_path / "sp2" / "checkpoint" / "step-2" / ".metadata")


def _validation_is_per_token(path, held_out):
    from model_harness import trained_like
    from titan_ulysses.distributed.utils import load_full_state_dict
    from titan_ulysses.ops.attention import build_attention_mask

    argv = sft_args(path) + ["--parallelism.ulysses_degree", "2", "--training.local_batch_size", "2",
                             "--training.global_batch_size", "2", "--training.steps", "1",
                             "--validation.enable", "true", "--validation.dataset_path", held_out,
                             "--validation.steps", "3"]
    trainer = Trainer_(load_config(argv))
    ref = Transformer(trainer.args)
    trained_like(ref)  # far from init: per-batch losses differ, so the two averages differ clearly
    load_full_state_dict(trainer.model, ref.state_dict())
    sums, counts = [], []
    with torch.no_grad():  # a plain forward on the same three batches
        for _, batch in zip(range(3), trainer.data.validation_loader()):
            mask = build_attention_mask("sdpa", batch["document_ids"])
            sums.append(float(ref(batch["input"], positions=batch["positions"], attention_mask=mask,
                                  labels=batch["labels"])))
            counts.append(int((batch["labels"] != IGNORE_INDEX).sum()))
    assert len(set(counts)) > 1, f"batch token counts should differ: {counts}"
    per_token = sum(sums) / sum(counts)
    per_batch = sum(s / c for s, c in zip(sums, counts)) / len(counts)
    assert abs(per_batch - per_token) > 1e-3 * per_token  # the test can tell them apart
    out = trainer.validator.run()
    assert out["validation_tokens"] == sum(counts)
    assert out["validation_loss"] == pytest.approx(per_token, rel=1e-5), (out, per_token, per_batch)


def Trainer_(config):
    from titan_ulysses.trainer import Trainer

    return Trainer(config)


def test_validation_loss_is_per_token_over_batches_of_unequal_token_counts(tmp_path):
    path, held_out = str(tmp_path / "sft.jsonl"), str(tmp_path / "val.jsonl")
    write_sft(path)
    write_sft(held_out, n=16, seed=1)
    run_distributed(_validation_is_per_token, 2, path, held_out)
