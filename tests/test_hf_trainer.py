"""integrations/transformers/trainer.py: transformers' Trainer and TRL's SFTTrainer at sp=2 equal one process.

Models: Granite (a family train.py does not have: multipliers on embeddings, residuals,
attention and logits) under Trainer, the real SmolLM2-135M (first 2 layers, its tokenizer)
under SFTTrainer, tiny Llamas for packing and DPO. One process runs each trainer as its docs write it (the reference, in the test's own process);
then 2 gloo ranks run the same script with ``ulysses_trainer(trainer, sp=2)`` added. With
gradient accumulation 2 over right-padded rows of uneven lengths (so per-rank or
per-micro-batch means would differ), the logged loss and gradient norm of every step and
the final weights equal the one-process run's. The optimizer is SGD: Adam's update divides by
the gradient's own size, which hides a wrong loss scale and turns fp32 noise on near-zero
gradients into whole steps. SFTTrainer: prompt-completion rows with completion-only loss,
and packing (padding-free rows, positions restarting at each document). DPOTrainer: the
sequence log-probabilities summed across the sp ranks; a planted per-rank partial sum
moves the loss away from one process's. Every case runs under accelerate's FSDP2 (``fsdp=True``; on
CPU too; DPO's reference model too) but one under DDP. dp2 x sp2 (4 processes): Granite under
Trainer (FSDP2) and a tiny Llama under SFTTrainer (DDP). SFT's logged entropy, token accuracy and
token count equal one process's too. The
example runs under ``accelerate launch`` with examples/accelerate_fsdp2.yaml (FSDP2 from
accelerate's config alone) against its own trainer in one process.
"""

from __future__ import annotations

import os

import pytest
import torch

from dist_utils import assert_close, run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

STEPS = 3
FSDP2 = {"fsdp": True, "fsdp_config": {"version": 2}}
"""TrainingArguments that put the model under FSDP2 (every rank): every case but DDP_KINDS runs under it."""
DDP_KINDS = {"sft_tiny"}
"""Cases run under DDP (torchrun, no fsdp in the arguments), so that path stays tested too (at dp2 x sp2)."""
SFT_METRICS = ("entropy", "mean_token_accuracy", "num_tokens")
"""What TRL's SFTTrainer logs each step besides the loss: under ulysses_trainer, one process's values."""


def tiny_granite():
    """Granite, a family train.py does not have: embedding, residual, attention and logit multipliers."""
    config = transformers.GraniteConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=128, pad_token_id=0,
                                        max_position_embeddings=128, embedding_multiplier=4.0, residual_multiplier=0.5,
                                        attention_multiplier=0.2, logits_scaling=2.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def tiny_llama(vocab: int = 128):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, vocab_size=vocab, pad_token_id=0,
                                      max_position_embeddings=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def token_rows(n: int = 24, vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (int(torch.randint(6, 21, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def collate(examples: list[dict]) -> dict:
    """Right padding: pad id 0, label -100, attention_mask 0."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        ids[i, :len(e["input_ids"])] = torch.tensor(e["input_ids"])
        mask[i, :len(e["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def common_args(out: str, batch: int, steps: int = STEPS) -> dict:
    return dict(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=2, max_steps=steps,
                learning_rate=0.5, optim="sgd", logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True,
                dataloader_drop_last=True, disable_tqdm=True)


def build_trainer(kind: str, out: str, batch: int, tokenizer_folder: str, smollm2_folder: str | None, **overrides):
    """``overrides``: TrainingArguments fields over common_args' (the GPU suite's bf16 on CUDA)."""
    import datasets

    if kind == "trainer":
        args = transformers.TrainingArguments(**{**common_args(out, batch), **overrides}, remove_unused_columns=False)
        dataset = datasets.Dataset.from_dict({"input_ids": token_rows()})
        return transformers.Trainer(model=tiny_granite(), args=args, train_dataset=dataset, data_collator=collate,
                                    eval_dataset=datasets.Dataset.from_dict({"input_ids": token_rows(16)}))
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    smollm2 = kind == "sft"  # the real SmolLM2-135M, its first 2 of 30 layers, and its tokenizer
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_folder if smollm2 else tokenizer_folder)
    if not smollm2:
        tokenizer.pad_token = "<|pad|>"
    words = "the pass key is 12345 remember it what def return tabs spaces and digits".split()
    g = torch.Generator().manual_seed(5)

    def text(n):
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))

    if kind == "dpo":  # pairs whose completions differ in length: a sequence's sum spans both sp ranks
        rows = {"prompt": [text(int(torch.randint(3, 8, (1,), generator=g))) for _ in range(24)],
                "chosen": [" " + text(int(torch.randint(2, 9, (1,), generator=g))) for _ in range(24)],
                "rejected": [" " + text(int(torch.randint(2, 9, (1,), generator=g))) for _ in range(24)]}
        args = DPOConfig(**{**common_args(out, batch), "bf16": False, **overrides}, max_length=64, beta=0.5)
        return DPOTrainer(model=tiny_llama(len(tokenizer)), ref_model=tiny_llama(len(tokenizer)), args=args,
                          train_dataset=datasets.Dataset.from_dict(rows), processing_class=tokenizer)

    rows = {"prompt": [text(int(torch.randint(2, 6, (1,), generator=g))) for _ in range(24)],
            "completion": [" " + text(int(torch.randint(2, 6, (1,), generator=g))) for _ in range(24)]}
    packing = kind == "sft_packed"
    # SFTConfig's default bf16 autocasts on CPU too: fp32 to compare exactly
    args = SFTConfig(**{**common_args(out, batch), "bf16": False, **overrides}, completion_only_loss=True,
                     packing=packing, max_length=64, padding_free=packing, dataset_num_proc=None)
    model = (transformers.AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32, num_hidden_layers=2)
             if smollm2 else tiny_llama(len(tokenizer)))
    evals = None
    # evaluation too (its loss and TRL's token metrics), batches as training's; at dp=1 only: at dp > 1 TRL's own eval
    # loss is a mean of the dp ranks' batch means and its metrics pool the dp ranks, which no one-process batching gives
    if kind == "sft":
        args.per_device_eval_batch_size = batch
        pairs = [(text(int(torch.randint(2, 6, (1,), generator=g))),
                  " " + text(int(torch.randint(2, 6, (1,), generator=g)))) for _ in range(16)]
        evals = datasets.Dataset.from_dict({"prompt": [p for p, _ in pairs], "completion": [c for _, c in pairs]})
    return SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict(rows), eval_dataset=evals,
                      processing_class=tokenizer)


def result(trainer) -> dict:
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    model = trainer.accelerator.unwrap_model(trainer.model)
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}  # FSDP2: gathered
    steps = [h for h in trainer.state.log_history if "loss" in h]
    metrics = {k: torch.tensor([h[k] for h in steps], dtype=torch.float64) for k in SFT_METRICS if k in steps[0]}
    return {"losses": torch.tensor(losses), "grad_norms": torch.tensor(norms), "metrics": metrics,
            "weights": {n: p.detach().clone() for n, p in full.items()}}


def one_process(kind: str, tmp, folders, dp: int = 1, steps: int = STEPS) -> dict:
    trainer = build_trainer(kind, str(tmp / f"one_{kind}"), 2 * dp, *folders, max_steps=steps)
    trainer.train()
    out = result(trainer)
    if kind == "trainer":
        out["eval"] = torch.tensor(trainer.evaluate()["eval_loss"])
    if kind == "sft":
        out["eval"] = trainer.evaluate()
    return out


def _sp_run(kinds: list[str], tmp: str, folders: tuple, refs: dict, steps: int = STEPS) -> None:
    """At sp=2 over every rank (dp = world / 2), each kind under FSDP2 (DDP_KINDS under DDP) against ``refs``'."""
    import torch.distributed as dist

    from titan_ulysses.integrations.transformers import ulysses_trainer

    rank, dp = dist.get_rank(), dist.get_world_size() // 2
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_WORLD_SIZE=str(dist.get_world_size()), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    # DPO's differentiable all-gather on an sp group that does not start at global rank 0 (every group but the first
    # at dp > 1; torch.distributed.nn's backward scattered from global rank 0 there): a group of rank 1 alone
    second = dist.new_group([1])
    if rank == 1:
        from titan_ulysses.integrations.transformers import dpo

        x = torch.arange(6.0).reshape(2, 3).requires_grad_()
        (dpo._gather_sequence(x, second) * 2).sum().backward()
        assert_close(x.grad, torch.full_like(x, 2.0), "all-gather backward on a group without rank 0")
    for kind in kinds:
        wrap = {} if kind in DDP_KINDS else FSDP2
        if not wrap:  # accelerate leaves ACCELERATE_USE_FSDP=true in the process after a trainer with an FSDP
            os.environ.pop("ACCELERATE_USE_FSDP", None)  # plugin: a later Accelerator (and ulysses_trainer) reads FSDP1
        if kind == "sft" and dp == 1:  # SFT scores through TRL's own fused head: a second fused loss is refused
            with pytest.raises(ValueError, match="TRL's own fused LM head"):
                ulysses_trainer(build_trainer(kind, f"{tmp}/refused", 2, *folders, max_steps=steps, **wrap), sp=2,
                                loss_chunk_size=16)
        trainer = ulysses_trainer(build_trainer(kind, f"{tmp}/sp_{kind}", 2, *folders, max_steps=steps, **wrap), sp=2)
        head = trainer.accelerator.unwrap_model(trainer.model).get_output_embeddings()
        calls = []
        hook = head.register_forward_hook(lambda m, a, out: calls.append(tuple(out.shape)))
        trainer.train()
        hook.remove()
        if kind.startswith("sft"):  # TRL's fused head: lm_head's module never runs, no [B, S/sp, vocab] logits
            assert calls == [], calls
        assert trainer.accelerator.is_fsdp2 == bool(wrap), (kind, trainer.accelerator.distributed_type)
        got, ref = result(trainer), refs[kind]
        assert len(got["losses"]) == steps
        if kind.startswith("sft"):  # TRL's metrics: one process's, or (fused loss) not logged at all
            assert set(got["metrics"]) == set(SFT_METRICS), got["metrics"].keys()
            for key, values in got["metrics"].items():
                assert_close(values, ref["metrics"][key], f"{kind} {key}", rtol=1e-5, atol=1e-6)
        if kind == "sft":  # evaluation: the loss and TRL's entropy and token accuracy of one process
            evaluated = trainer.evaluate()
            for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
                assert_close(torch.tensor(evaluated[key]), torch.tensor(ref["eval"][key]), key)
        if kind == "dpo":  # the reference model too, as TRL shards it where accelerate keeps FSDP (GPU)
            from torch.distributed.fsdp import FSDPModule

            assert isinstance(trainer.ref_model, FSDPModule), type(trainer.ref_model)
        assert_close(got["losses"], ref["losses"], f"{kind} losses")
        assert_close(got["grad_norms"], ref["grad_norms"], f"{kind} grad norms")
        for n, w in ref["weights"].items():
            assert_close(got["weights"][n], w, f"{kind} weight {n}", rtol=1e-5, atol=1e-5)
        if kind == "dpo":  # the classic bug planted: each rank's partial sum of a sequence's log-probabilities
            from titan_ulysses.integrations.transformers import dpo

            gather = dpo._gather_sequence
            dpo._gather_sequence = lambda x, group: torch.cat(
                [x if r == dist.get_rank() else torch.zeros_like(x) for r in range(dist.get_world_size())], dim=1)
            planted = ulysses_trainer(build_trainer(kind, f"{tmp}/planted", 2, *folders, **FSDP2), sp=2)
            planted.args.max_steps = 1
            planted.train()
            dpo._gather_sequence = gather
            bad = result(planted)["grad_norms"]  # the first loss is log 2 either way: policy = reference
            assert (bad[0] - ref["grad_norms"][0]).abs() > 1e-2 * ref["grad_norms"][0], (bad, ref["grad_norms"])
        if kind == "trainer" and dp == 1:  # Granite's logits_scaling through the fused loss (chunks of 8), tiled MLPs
            fused = ulysses_trainer(build_trainer(kind, f"{tmp}/fused", 2, *folders, **FSDP2), sp=2, loss_chunk_size=8,
                                    mlp_tile_size=4)
            fused.train()
            mem = result(fused)
            assert_close(mem["losses"], ref["losses"], "fused loss, tiled MLP: losses")
            assert_close(mem["grad_norms"], ref["grad_norms"], "fused loss, tiled MLP: grad norms")
            for n, w in ref["weights"].items():
                assert_close(mem["weights"][n], w, f"fused loss, tiled MLP: weight {n}", rtol=1e-5, atol=1e-5)
            assert_close(torch.tensor(fused.evaluate()["eval_loss"]), ref["eval"], "fused loss: eval loss")
        if kind == "trainer":
            assert_close(torch.tensor(trainer.evaluate()["eval_loss"]), ref["eval"], "eval loss")
            trainer.save_model(f"{tmp}/saved")
            if rank == 0:
                saved = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp}/saved")
                assert saved.config._attn_implementation == "sdpa"
                for n, p in saved.named_parameters():
                    assert_close(p, ref["weights"][n], f"saved {n}")
            dist.barrier()


def test_trainer_sft_and_dpo_at_sp2_equal_one_process(tmp_path, smollm2_hf_folder):
    from hf_fixtures import make_tokenizer

    folders = (str(tmp_path / "tokenizer"), smollm2_hf_folder)
    make_tokenizer(folders[0])
    kinds = ["trainer", "sft", "sft_packed", "dpo"]
    refs = {kind: one_process(kind, tmp_path, folders) for kind in kinds}
    run_distributed(_sp_run, 2, kinds, str(tmp_path), folders, refs)


def test_trainer_and_sft_at_dp2_sp2_equal_one_process(tmp_path):
    """dp2 x sp2 (4 processes): rows sharded by the dp rank only, the step's token count summed over dp, evaluation
    averaged over dp, sp groups that do not start at rank 0. Granite under Trainer (FSDP2) and a tiny Llama under
    SFTTrainer (completion-only, DDP), 2 steps, against one process taking both dp ranks' rows."""
    from hf_fixtures import make_tokenizer

    folders = (str(tmp_path / "tokenizer"), None)
    make_tokenizer(folders[0])
    kinds = ["trainer", "sft_tiny"]
    refs = {kind: one_process(kind, tmp_path, folders, dp=2, steps=2) for kind in kinds}
    run_distributed(_sp_run, 4, kinds, str(tmp_path), folders, refs, 2)


def test_the_trl_example_under_accelerate_launch_fsdp2_equals_one_process(tmp_path, smollm2_hf_folder):
    """``accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/trl_sft.py`` at sp=2 on SmolLM2-135M's
    first 2 layers: FSDP2 asked for by accelerate's config alone (accelerate drops it on CPU: the run was silently DDP)
    trains under FSDP2; every step's loss and grad norm and the saved weights equal the example's trainer in one
    process (this one), and transformers reloads the folder with the model's own kernel."""
    import importlib.util
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = ["--model", smollm2_hf_folder, "--layers", "2", "--steps", "2", "--optim", "sgd", "--lr", "0.05",
             "--text", os.path.join(root, "README.md")]
    out = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          "examples/accelerate_fsdp2.yaml", "examples/trl_sft.py", *flags, "--output",
                          str(tmp_path / "trl_sft")], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads(out.stdout.strip().splitlines()[-1])
    assert run["wrap"] == "FSDP2", out.stdout[-2000:]
    spec = importlib.util.spec_from_file_location("trl_sft", os.path.join(root, "examples", "trl_sft.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    one = example.make_trainer(example.parse([*flags, "--output", str(tmp_path / "one")]))
    one.train()
    ref = result(one)
    assert len(run["loss"]) == 2
    assert_close(torch.tensor(run["loss"]), ref["losses"], "example losses")
    assert_close(torch.tensor(run["grad_norm"]), ref["grad_norms"], "example grad norms")
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "trl_sft")
    assert saved.config._attn_implementation == "sdpa" and saved.config.num_hidden_layers == 2
    for n, p in saved.named_parameters():
        assert_close(p, ref["weights"][n], f"saved {n}")


def test_fsdp1_from_accelerate_launch_is_refused(monkeypatch):
    """accelerate launch with fsdp_version: 1 in its config (its environment, no fsdp in the TrainingArguments): one
    line, not FSDP1 and not a silent DDP."""
    from types import SimpleNamespace

    from titan_ulysses.integrations.transformers import ulysses_trainer

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    trainer = transformers.Trainer.__new__(transformers.Trainer)  # the check reads args only: no model, no group
    trainer.args = SimpleNamespace(fsdp_plugin_args=None)
    trainer.compute_metrics = trainer.compute_loss_func = None
    with pytest.raises(ValueError, match=r"FSDP1 .*fsdp_version: 2") as e:
        ulysses_trainer(trainer, 2)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("sizes", [{"sp_size": 2}, {"cp_size": 2}, {"tp_size": 2},
                                   {"dp_replicate_size": 2, "dp_shard_size": 2}])
def test_a_parallelism_config_that_contradicts_sp_is_refused(sizes):
    """accelerate's ParallelismConfig with another sequence split (DeepSpeed's sp, cp), tp or HSDP: one line."""
    from types import SimpleNamespace

    from accelerate.parallelism_config import ParallelismConfig

    from titan_ulysses.integrations.transformers import ulysses_trainer

    trainer = transformers.Trainer.__new__(transformers.Trainer)  # the check reads args only: no model, no group
    trainer.args = SimpleNamespace(fsdp_plugin_args=None, parallelism_config=ParallelismConfig(**sizes))
    trainer.compute_metrics = trainer.compute_loss_func = None
    key = next(iter(sizes))
    with pytest.raises(ValueError, match=rf"ParallelismConfig has .*{key}=2.* contradicts sp=2") as e:
        ulysses_trainer(trainer, 2)
    assert "\n" not in str(e.value)


def test_at_dp1_the_last_short_batch_stays_short():
    """accelerate shards the loader over every process; ulysses_trainer re-shards it by the dp rank. At dp=1 the
    epoch's short last batch is one process's (accelerate's even_batches completed it with the epoch's first row, so
    that row was trained twice)."""
    from types import SimpleNamespace

    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    from titan_ulysses.integrations.transformers.trainer import _reshard

    rows = BatchSampler(SequentialSampler(range(5)), batch_size=2, drop_last=False)
    for dp, expected in ((1, [[[0, 1], [2, 3], [4]]]), (2, [[[0, 1], [4, 0]], [[2, 3], [1, 2]]])):
        for rank in range(dp):  # at dp=2 accelerate's own even batches, as DDP without sp gets them
            loader = SimpleNamespace(batch_sampler=BatchSamplerShard(rows, num_processes=4, process_index=rank))
            assert list(_reshard(loader, dp, rank).batch_sampler) == expected[rank], (dp, rank)
