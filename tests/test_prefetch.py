"""The data path runs ahead (issue 40 item 4), checked by counting, never by timing:

* each rank copies only its own slice to the device (the elements passed to ``Tensor.to``
  are those of the local shard, with padding, cp order and full document ids as before);
* passkey samples built with numpy are token for token those of the former list builder;
* in the trainer, a thread reads ``prefetch_batches`` steps ahead of the step being trained,
  the checkpointed loader state is that after the steps consumed (a resume trains on the
  batches of the uninterrupted run), and the thread is gone after training and after an error.
"""

import random
import threading
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dist_utils import run_distributed
from titan_ulysses.data.datasets import _FILLER, PasskeyDataset, make_passkey_tokens
from titan_ulysses.data.sharding import shard_batch, shard_loader_batch
from titan_ulysses.data.tokenizer import ByteTokenizer
from titan_ulysses.ops.loss import IGNORE_INDEX


class CountTo(TorchFunctionMode):
    """Elements of every tensor copied with ``Tensor.to(device)``."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            self.elements += args[0].numel()
        return func(*args, **kwargs)


@pytest.mark.parametrize("sp,cp,packed", [(4, 1, False), (2, 2, True)])
def test_each_rank_copies_only_its_slice_to_the_device(sp, cp, packed):
    b, s = 2, 30  # padded to 32 (sp 4) or 40 (2 x cp x sp = 8)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 100, (b, s + 1), generator=g)
    docs = torch.cat([torch.zeros(b, 11, dtype=torch.long), torch.ones(b, s - 11, dtype=torch.long)], 1)
    positions = torch.cat([torch.arange(11), torch.arange(s - 11)]).expand(b, s).clone()
    batch = {"input": tokens[:, :-1], "labels": tokens[:, 1:], "document_ids": docs, "positions": positions}
    for rank in range(sp * cp):
        cp_rank, sp_rank = divmod(rank, sp)
        with CountTo() as mode:
            got = shard_loader_batch(batch, sp_rank, sp, "cpu", packed, pad_token=0, cp_rank=cp_rank, cp=cp)
        ref = shard_batch(batch["input"], batch["labels"], sp_rank, sp, positions=positions,
                          document_ids=docs if packed else None, cp_rank=cp_rank, cp=cp)
        fields = ("tokens", "labels", "positions", "document_ids", "index")
        for f in fields:
            a, e = getattr(got, f), getattr(ref, f)
            assert (a is None) == (e is None) and (a is None or torch.equal(a, e)), f
        local = sum(getattr(got, f).numel() for f in fields if getattr(got, f) is not None)
        assert mode.elements == local, f"rank {rank} copied {mode.elements} elements, its slice holds {local}"


def old_passkey_item(tokenizer, seq_len, passkey, depth):
    """The former list builder of a passkey sample (reference for the numpy one)."""
    needle = tokenizer.encode(f" The pass key is {passkey}. Remember it. {passkey} is the pass key. ", False, False)
    question = tokenizer.encode(" What is the pass key? The pass key is ", False, False)
    answer = tokenizer.encode(str(passkey), False, False)
    n_filler = seq_len + 1 - 1 - len(needle) - len(question) - len(answer)
    unit = tokenizer.encode(_FILLER, False, False)
    filler = (unit * (n_filler // len(unit) + 1))[:n_filler]
    cut = int(round(depth * n_filler))
    tokens = [tokenizer.bos_id] + filler[:cut] + needle + filler[cut:] + question + answer
    t = torch.tensor(tokens, dtype=torch.long)
    docs = torch.zeros_like(t)
    labels = t[1:].clone()
    labels[docs[1:] != docs[:-1]] = IGNORE_INDEX
    item = {"input": t[:-1], "labels": labels, "document_ids": docs[:-1], "positions": torch.arange(len(t))[:-1]}
    return item, tokens, len(tokens) - len(answer)


def test_numpy_passkey_samples_equal_the_former_list_builder():
    tok = ByteTokenizer()
    for seed in (0, 3, 1234):
        for seq_len in (120, 333):
            ds = PasskeyDataset(tok, seq_len, seed, digits=1 + seed % 5)
            for index in (0, 1, 17):
                key, depth = ds.key_and_depth(index)
                item, _, _ = old_passkey_item(tok, seq_len, key, depth)
                new = ds[index]
                assert set(new) == set(item)
                for k in item:
                    assert new[k].dtype == item[k].dtype and torch.equal(new[k], item[k]), (seed, seq_len, index, k)
    rng = random.Random(5)
    for depth in (0.0, 1.0, rng.random()):  # eval_needle's prompts: tokens and where the answer starts
        _, tokens, start = old_passkey_item(tok, 200, 98765, depth)
        new, new_start = make_passkey_tokens(tok, 200, 98765, depth)
        assert new.tolist() == tokens and new_start == start


def _records(trainer):
    """Per step: the tokens the model got, and how many samples the dataset had built by the step's end."""
    built, seen = [0], []
    shard = trainer.data.dataloader.dataset
    inner = shard.dataset.__getitem__

    class Counting:  # the dataset, counting the samples read
        def __len__(self):
            return 2**31

        def __getitem__(self, i):
            built[0] += 1
            return inner(i)

    shard.dataset = Counting()
    trainer.model.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    return built, seen


def _prefetch_and_resume(folder):
    from titan_ulysses.config.manager import load_config
    from titan_ulysses.trainer import Trainer

    argv = ["--model.flavor", "debugmodel", "--training.seq_len", "128", "--training.local_batch_size", "2",
            "--training.global_batch_size", "4", "--training.mixed_precision_param", "float32",
            "--training.prefetch_batches", "2", "--job.dump_folder", folder, "--metrics.log_freq", "100"]
    per_step = 4  # samples of a step: 2 microbatches of 2
    trainer = Trainer(load_config(argv + ["--training.steps", "3"]))
    built, seen = _records(trainer)
    ahead, states = [], {}  # at the end of each step, once the thread has caught up: samples read so far

    def log_ahead(step, *args, **kwargs):
        deadline = time.monotonic() + 20
        expected = (step + 2) * per_step  # the thread reads up to 2 steps past the one trained
        while built[0] < expected and time.monotonic() < deadline:
            time.sleep(0.01)
        ahead.append(built[0])
        states[step] = trainer.dataloader.state_dict()  # what a checkpoint of this step holds
        return real_save(step, *args, **kwargs)

    real_save = trainer.checkpointer.save
    trainer.checkpointer.save = log_ahead
    trainer.train()
    assert ahead == [3 * per_step, 4 * per_step, 5 * per_step], ahead  # never more than 2 steps ahead
    assert not any(t.name == "titan-data-prefetch" for t in threading.enumerate()), "thread alive after training"
    full = list(seen)  # 2 microbatches per step

    # a resume from step 2 (DCP's part of it: test_trainer.py's resume test, at the default prefetch of 2),
    # in the same trainer (which weights it trains does not matter here)
    trainer.dataloader.load_state_dict(states[2])
    trainer.step = 2
    trainer.checkpointer.save = real_save
    seen.clear()
    trainer.model.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(ValueError("planted"))
                                            if len(seen) > 1 else None)
    with pytest.raises(ValueError, match="planted"):  # step 3 fails: the thread must still stop
        trainer.train()
    assert not any(t.name == "titan-data-prefetch" for t in threading.enumerate()), "thread alive after an error"
    assert len(seen) == 2 and len(full) == 6
    for got, want in zip(seen, full[4:6]):  # step 3's two microbatches
        assert torch.equal(got, want)
    assert states[2]["dataset_state"]["samples_consumed"] == 2 * per_step


def test_prefetch_reads_ahead_resumes_exactly_and_stops(tmp_path):
    run_distributed(_prefetch_and_resume, 1, str(tmp_path))
