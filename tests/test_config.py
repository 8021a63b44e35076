"""Config loading, overrides and every refusal, without any process group."""

import pytest

from titan_ulysses.config.manager import ConfigError, load_config, resolved_global_batch_size
from titan_ulysses.preflight import validate


def test_defaults_and_toml_and_overrides(tmp_path):
    assert load_config([]).training.seq_len == 2048
    path = tmp_path / "x.toml"
    path.write_text('[training]\nseq_len = 4096\nsteps = 7\n[compile]\nenable = true\n[optimizer]\nlr = 1\n')
    c = load_config(["--config", str(path), "--training.steps", "9", "--compile.enable=false",
                     "--optimizer.lr", "3e-4", "--job.description", "hi there", "--checkpoint.enable", "TRUE"])
    assert c.training.seq_len == 4096  # from the file
    assert c.training.steps == 9 and c.compile.enable is False  # the command line wins
    assert c.optimizer.lr == 3e-4 and isinstance(c.optimizer.lr, float)
    assert c.job.description == "hi there" and c.checkpoint.enable is True


@pytest.mark.parametrize("name,world,degrees", [
    ("debug_model", 2, {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "sp": 2, "tp": 1}),
    ("needle_demo", 2, {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "sp": 2, "tp": 1}),
    ("llama3_8b_128k", 8, {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "sp": 8, "tp": 1}),
    ("llama3_8b_512k", 32, {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "sp": 8, "tp": 1}),
    ("llama3_1b_long", 8, {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "sp": 8, "tp": 1}),
    ("llama3_8b_6m", 8, {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "sp": 8, "tp": 1}),
    ("llama3_8b_1m_one_h200", 1, {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "sp": 1, "tp": 1}),
    ("llama3_1b_2m_one_gpu", 1, {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "sp": 1, "tp": 1}),
])
def test_the_shipped_configs_load_and_validate(name, world, degrees):
    c = load_config(["--config", f"train_configs/{name}.toml"])
    assert validate(c, world).degrees == degrees


@pytest.mark.parametrize("argv,message", [
    (["--training.seq_lenn", "5"], r"unknown key 'training.seq_lenn'; did you mean 'training.seq_len'\?"),
    (["--trainin.steps", "5"], r"did you mean 'training.steps'\?"),
    (["--compile.enable", "yes"], r"compile.enable expects bool \(true or false\), got 'yes'"),
    (["--training.steps", "ten"], r"training.steps expects int, got 'ten'"),
    (["--model.attn_backend", "xformers"], r"model.attn_backend 'xformers' is not one of"),
    (["--training.steps"], r"--training.steps needs a value"),
    (["stray"], r"unexpected argument 'stray'"),
])
def test_bad_command_lines(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(argv)


def test_bad_toml_types(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text('[training]\nsteps = "many"\n')
    with pytest.raises(ConfigError, match="training.steps expects int, got 'many'"):
        load_config(["--config", str(path)])
    for toml, key in (('steps = "10"', "training.steps"), ('max_norm = "1.0"', "training.max_norm"),
                      ('deterministic = "true"', "training.deterministic")):
        path.write_text(f'[training]\n{toml}\n')  # a quoted number is a string in TOML: refused with the key
        with pytest.raises(ConfigError, match=rf"{key} expects \w+( \(true or false\))?, got '.*' \(a string in .*x.toml: write "):
            load_config(["--config", str(path)])
    assert load_config(["--training.steps", "10"]).training.steps == 10  # the command line is text: converted
    path.write_text('[trainig]\nsteps = 3\n')
    with pytest.raises(ConfigError, match="did you mean 'training.steps'"):
        load_config(["--config", str(path)])
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_config(["--config", str(tmp_path / "missing.toml")])


@pytest.mark.parametrize("argv,world,message", [
    (["--parallelism.ulysses_degree", "2", "--parallelism.data_parallel_shard_degree", "2"], 8,
     r"parallelism: .* = 4, but the world size is 8"),
    (["--parallelism.ulysses_degree", "32", "--training.seq_len", "2048"], 32,
     r"ulysses_degree 32 is larger than the 16 attention heads .*ulysses_degree can be at most 16; .*= 16 x 2, 8 x 4"),
    (["--parallelism.ulysses_degree", "3", "--training.seq_len", "1000", "--model.flavor", "debugmodel_gqa1"], 3,
     r"training.seq_len: seq_len 1000 is not divisible by ulysses_degree 3"),  # 16 heads over 3 ranks: unevenly
    (["--parallelism.ulysses_degree", "4", "--training.seq_len", "1001"], 4, r"training.seq_len: seq_len 1001 is not divisible by ulysses_degree 4; use seq_len 1000 or 1004"),
    (["--training.global_batch_size", "6", "--training.local_batch_size", "4"], 1, r"training.global_batch_size 6 must be a positive multiple"),
    (["--training.dataset", "text"], 1, r"training.dataset 'text' needs training.dataset_path"),
    (["--model.tokenizer", "tiktoken"], 1, r"model.tokenizer 'tiktoken' needs model.tokenizer_path"),
    (["--model.flavor", "7B"], 1, r"model.flavor: model flavor '7B' is not one of"),
    (["--training.steps", "0"], 1, r"training.steps must be positive"),
    (["--training.passkey_digits", "0"], 1, r"training.passkey_digits must lie in \[1, 9\], got 0"),
    # every numeric setting has a range, refused before any process group (issue 15)
    (["--optimizer.lr", "nan"], 1, r"optimizer.lr must be a finite number, got nan"),
    (["--optimizer.lr", "inf"], 1, r"optimizer.lr must be a finite number, got inf"),
    (["--optimizer.beta1", "2.0"], 1, r"optimizer.beta1 must lie in \[0, 1\), got 2.0"),
    (["--optimizer.beta2", "1"], 1, r"optimizer.beta2 must lie in \[0, 1\), got 1.0"),
    (["--optimizer.eps", "0"], 1, r"optimizer.eps must be positive, got 0.0"),
    (["--optimizer.weight_decay", "-0.1"], 1, r"optimizer.weight_decay must be >= 0, got -0.1"),
    (["--comm.link_bandwidth_gbps", "0"], 1, r"comm.link_bandwidth_gbps must be positive, got 0.0"),
    (["--lr_scheduler.min_lr_factor", "-5"], 1, r"lr_scheduler.min_lr_factor must lie in \[0, 1\], got -5.0"),
    (["--lr_scheduler.min_lr_factor", "nan"], 1, r"lr_scheduler.min_lr_factor must be a finite number, got nan"),
    (["--lr_scheduler.decay_ratio", "1.5"], 1, r"lr_scheduler.decay_ratio must lie in \[0, 1\], got 1.5"),
    (["--training.max_norm", "-1"], 1, r"training.max_norm must be >= 0, got -1.0"),
    (["--training.skip_nonfinite_steps", "-1"], 1, r"training.skip_nonfinite_steps must be >= 0, got -1"),
    (["--comm.train_timeout_seconds", "0"], 1, r"comm.train_timeout_seconds must lie in \(0, 2592000\], got 0"),
    (["--comm.init_timeout_seconds", "-3"], 1, r"comm.init_timeout_seconds must lie in \(0, 2592000\], got -3"),
    # issue 20: 1e20 overflowed timedelta, 1e10 wrapped into a false timeout, lr 1e40 overflowed AdamW
    (["--comm.init_timeout_seconds", str(10**20)], 1, r"comm.init_timeout_seconds must lie in \(0, 2592000\]"),
    (["--comm.train_timeout_seconds", str(10**10)], 1, r"comm.train_timeout_seconds must lie in \(0, 2592000\]"),
    (["--optimizer.lr", "1e40"], 1, r"optimizer.lr must lie in \(0, 1.0\], got 1e\+40"),
    (["--model.rope_theta", "inf"], 1, r"model.rope_theta must be a finite number, got inf"),
    (["--training.seed", "-1"], 1, r"training.seed must lie in \[0, 9223372036854775807\], got -1"),
])
def test_validation_refusals(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(argv), world)


def test_global_batch_resolution():
    c = load_config(["--training.local_batch_size", "2"])
    assert resolved_global_batch_size(c, 4) == 8
    c = load_config(["--training.local_batch_size", "2", "--training.global_batch_size", "16"])
    assert resolved_global_batch_size(c, 4) == 16  # 2 microbatches per step


def test_every_numeric_setting_has_a_range():
    from titan_ulysses.config.ranges import EXEMPT, RANGES, numeric_fields

    fields = set(numeric_fields(load_config([])))
    assert fields - set(RANGES) - EXEMPT == set(), "numeric settings without a range"
    assert set(RANGES) - fields == set(), "ranges of settings that do not exist"


def test_head_stages_that_do_not_divide_the_heads_are_refused_before_any_process_group():
    c = load_config(["--config", "train_configs/llama3_8b_6m.toml", "--parallelism.ulysses_head_stages", "3"])
    with pytest.raises(ConfigError, match=r"parallelism.ulysses_head_stages 3 does not divide the 4 q heads per rank "
                                          r"\(32 heads over ulysses_degree 8\); use one of \[1, 2, 4\]"):
        validate(c, 8)
    c = load_config(["--config", "train_configs/llama3_8b_6m.toml", "--parallelism.ulysses_head_stages", "0"])
    with pytest.raises(ConfigError, match=r"parallelism.ulysses_head_stages"):
        validate(c, 8)
