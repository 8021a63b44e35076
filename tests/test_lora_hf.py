"""LoRA SFT from a Hugging Face folder at sp=2 through train.py (with the chunked loss), then both exports.

The run learns (the loss of a fixed assistant answer falls), the base weights in its
checkpoint are bit-identical to the folder's, every adapter's weight change has rank <= lora.rank,
and the trainer's own logits (our model with the checkpoint's weights) equal those of the
merged export in transformers and of the peft export loaded onto the base with peft.
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hf_fixtures import make_hf_model, make_tokenizer
from titan_ulysses.interop.hf_adapter import from_hf
from titan_ulysses.interop.hf_export import read_model_record, read_model_weights
from titan_ulysses.distributed.lora import LoRAOptions, apply_lora
from titan_ulysses.models.decoder.model import Transformer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK, ALPHA, STEPS = 4, 8.0, 16
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _run(cmd, timeout=300):
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc.stdout


def _export_script():
    spec = importlib.util.spec_from_file_location("export_hf_script", os.path.join(ROOT, "scripts", "export_hf.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.slow
def test_lora_sft_from_hf_folder_learns_and_exports(tmp_path):
    from safetensors.torch import load_file

    folder = str(tmp_path / "base")
    make_tokenizer(folder)
    base = make_hf_model(folder, "llama", dict(tie_word_embeddings=False), bos_token_id=0, eos_token_id=1)
    config_path = os.path.join(folder, "tokenizer_config.json")
    tok_config = json.load(open(config_path))
    json.dump({**tok_config, "chat_template": TEMPLATE}, open(config_path, "w"))
    rng = np.random.default_rng(0)
    with open(tmp_path / "chat.jsonl", "w") as f:
        for _ in range(200):  # random questions, always the same answer
            question = "".join(rng.choice(list("abcdefgh"), int(rng.integers(3, 9)))) + "?"
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": "The pass key is 12345."}]}) + "\n")
    run = tmp_path / "run"
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
                "--model.hf_assets_path", folder, "--model.tokenizer", "hf", "--checkpoint.initial_load_in_hf", "true",
                "--job.dump_folder", str(run), "--parallelism.ulysses_degree", "2",
                "--training.dataset", "sft", "--training.dataset_path", str(tmp_path / "chat.jsonl"),
                "--training.seq_len", "128", "--training.local_batch_size", "2", "--training.steps", str(STEPS),
                "--training.mixed_precision_param", "float32", "--optimizer.lr", "1e-2",
                "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", "1",
                "--checkpoint.enable", "true", "--checkpoint.interval", str(STEPS),
                "--model.loss_chunk_size", "48", "--lora.rank", str(RANK), "--lora.alpha", str(ALPHA)])
    assert f"LoRA rank {RANK} on q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj" in out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert np.mean(losses[-3:]) < 0.5 * losses[0], losses  # it learns the answer
    # (in, out) of q, k, v, o, gate, up, down in each of 2 layers; an adapter has rank x (in + out)
    shapes = [(64, 64), (64, 16), (64, 16), (64, 64), (64, 128), (64, 128), (128, 64)]
    trainable = 2 * RANK * sum(i + o for i, o in shapes)
    assert records[0]["trainable_params"] == trainable and records[0]["params"] == trainable + base.num_parameters()

    step = run / "checkpoint" / f"step-{STEPS}"
    args = read_model_record(str(step))[0]
    saved = read_model_weights(str(step))
    hf_base = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            hf_base.update(load_file(os.path.join(folder, name)))
    for name, w in from_hf(hf_base, args).items():  # the frozen base did not move by one bit
        assert torch.equal(saved[name], w), name
    for name in [n for n in saved if n.endswith("lora_A")]:
        delta = saved[name.replace("lora_A", "lora_B")] @ saved[name]
        assert 0 < torch.linalg.matrix_rank(delta) <= RANK, name

    # the trainer's own model, with the checkpoint's weights
    ours = Transformer(args)
    apply_lora(ours, LoRAOptions(rank=RANK, alpha=ALPHA), torch.float32)
    ours.load_state_dict(saved)
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(tokens)
        base_logits = base(tokens).logits
    assert (expected - base_logits).abs().max() > 0.05  # the adapters changed the model

    export = _export_script()  # the command line, in this process (no second interpreter start)
    assert export(["--checkpoint", str(step), "--output", str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    merged.config._attn_implementation = "eager"
    assert export(["--checkpoint", str(step), "--output", str(tmp_path / "adapter"), "--adapter-only"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == folder and config["r"] == RANK and config["lora_alpha"] == ALPHA
    names = set(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in names and len(names) == 2 * 7 * 2
    fresh = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    fresh.config._attn_implementation = "eager"
    with_adapter = peft.PeftModel.from_pretrained(fresh, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(with_adapter(tokens).logits, expected, rtol=1e-4, atol=1e-4)


def _save_lora_checkpoint(folder, out):
    """A LoRA model at sp=2 on a Hugging Face folder's weights, random (nonzero) adapters, one checkpoint."""
    import torch.distributed as dist

    from titan_ulysses.interop.hf_weights import load_hf_weights
    from titan_ulysses.interop.hf_export import write_model_record
    from titan_ulysses.interop.peft_export import write_lora_record
    from titan_ulysses.checkpoint.manager import CheckpointManager
    from titan_ulysses.distributed.lora import init_state
    from titan_ulysses.distributed.parallel_dims import ParallelDims
    from titan_ulysses.distributed.utils import load_full_state_dict
    from titan_ulysses.models.decoder.parallelize import ParallelizeOptions, parallelize_decoder
    from titan_ulysses.interop.hf_config import load_hf_args

    pd = ParallelDims(sp=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    args = load_hf_args(folder)
    lora = LoRAOptions(rank=RANK, alpha=ALPHA)
    with torch.device("meta"):
        model = Transformer(args)
    parallelize_decoder(model, pd, ParallelizeOptions(param_dtype=torch.float32, lora=lora))
    model.to_empty(device="cpu")
    model.init_buffers()
    load_hf_weights(model, folder)
    g = torch.Generator().manual_seed(1)
    adapters = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in init_state(model, 0).items()}
    load_full_state_dict(model, adapters, strict=False)
    opt = torch.optim.AdamW(model.parameters())
    CheckpointManager(folder=out, model=model, optimizer=opt, lr_scheduler=opt, dataloader=opt, enable=True,
                      interval=1, extras=lambda d: (write_model_record(d, args, folder),
                                                    write_lora_record(d, lora, folder))).save(1)


@pytest.mark.parametrize("variant", ["qwen3-tied-headdim"])  # q/k norms, its own head_dim, tied embeddings
def test_lora_exports_of_other_families_give_the_trainers_logits(tmp_path, variant):
    from dist_utils import run_distributed
    from hf_fixtures import VARIANTS

    model_type, overrides, _ = VARIANTS[variant]
    folder = str(tmp_path / "base")
    make_hf_model(folder, model_type, overrides)
    run_distributed(_save_lora_checkpoint, 2, folder, str(tmp_path / "ckpt"))
    step = str(tmp_path / "ckpt" / "step-1")
    args = read_model_record(step)[0]
    ours = Transformer(args)
    apply_lora(ours, LoRAOptions(rank=RANK, alpha=ALPHA), torch.float32)
    ours.load_state_dict(read_model_weights(step))
    export = _export_script()
    assert export(["--checkpoint", step, "--output", str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    assert export(["--checkpoint", step, "--output", str(tmp_path / "adapter"), "--adapter-only"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for m in (merged, base):
        m.config._attn_implementation = "eager"
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(tokens)
        assert (expected - base(tokens).logits).abs().max() > 0.05  # the adapters matter
        with_adapter = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        torch.testing.assert_close(merged(tokens).logits, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(with_adapter(tokens).logits, expected, rtol=1e-4, atol=1e-4)
