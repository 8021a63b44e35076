"""Issue 33, items 2 and 3 and the index: a Hugging Face folder's safetensors are refused, in one
line naming the tensor and its file, when loading them would silently change the model:

* a tensor the model does not use (it was dropped: ``tie_word_embeddings: true`` beside an
  ``lm_head.weight`` loaded 20 of the file's 21 tensors); a tied head equal to the embedding,
  and transformers' own ignorable ``rotary_emb.inv_freq``, are accepted;
* an integer, float8 or float64 tensor (an int8 ``q_proj.weight`` was cast to float and trained);
* an index naming a shard file that is not there.
All from the headers (no process group), as the pre-flight runs them.
"""

import json
import os
import shutil

import pytest
import torch

from hf_fixtures import make_hf_model
from titan_ulysses.interop.hf_weights import check_hf_weights
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.interop.hf_config import load_hf_args
from titan_ulysses.preflight import check_files

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    make_hf_model(str(root / "tied"), "llama", dict(tie_word_embeddings=True))
    make_hf_model(str(root / "untied"), "llama", dict(tie_word_embeddings=False))
    make_hf_model(str(root / "sharded"), "llama", dict(tie_word_embeddings=False), max_shard_size="40KB")
    return root


def _edit(source, dest, change):
    """A copy of the folder ``source`` whose model.safetensors went through ``change(tensors)``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    file = os.path.join(dest, "model.safetensors")
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return str(dest), file


def _refusal(folder):
    with pytest.raises(ValueError) as e:
        check_hf_weights(folder, load_hf_args(folder))
    message = str(e.value)
    assert "\n" not in message
    return message


def test_a_tied_head_that_differs_from_the_embedding_is_refused_naming_both(folders, tmp_path):
    def add_head(tensors):
        tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])

    folder, file = _edit(folders / "tied", tmp_path / "differs", add_head)
    assert _refusal(folder) == (
        f"config.json says tie_word_embeddings true, but {file} holds 'lm_head.weight' and it differs from "
        f"'model.embed_tokens.weight' ({file}): a tied model would drop the head; set tie_word_embeddings false in "
        f"config.json if the head is trained apart (transformers then keeps both)")
    # the pre-flight of a launch says it, naming the setting
    with pytest.raises(ConfigError, match=r"^checkpoint.initial_load_in_hf: model.hf_assets_path .*differs from "
                                          r"'model.embed_tokens.weight'"):
        check_files(load_config(["--model.hf_assets_path", folder, "--parallelism.ulysses_degree", "1"]))

    def same_head(tensors):  # as torch .bin conversions save a tied model: both, equal
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    folder, _ = _edit(folders / "tied", tmp_path / "equal", same_head)
    check_hf_weights(folder, load_hf_args(folder))


def test_a_tensor_the_model_does_not_use_is_refused_and_inv_freq_is_not(folders, tmp_path):
    def add_unused(tensors):
        tensors["model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 64)
        tensors["model.vision_tower.proj.weight"] = torch.zeros(2, 2)

    folder, file = _edit(folders / "untied", tmp_path / "unused", add_unused)
    assert _refusal(folder) == (
        f"{file} holds 'model.layers.0.self_attn.q_proj.lora_A.weight' (and 1 more), which the model of config.json "
        f"does not use, so the load would drop it: config.json does not describe these weights (or they are another "
        f"model's); fix config.json or remove the tensor")

    def add_inv_freq(tensors):  # older transformers saved these; transformers drops them on load too
        for i in range(2):
            tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(4)

    folder, _ = _edit(folders / "untied", tmp_path / "inv_freq", add_inv_freq)
    check_hf_weights(folder, load_hf_args(folder))


@pytest.mark.parametrize("dtype,kind", [(torch.int8, "I8, an integer"), (torch.float8_e4m3fn, "F8_E4M3, a quantized"),
                                        (torch.float64, "F64, an unexpected")])
def test_integer_quantized_and_other_dtypes_are_refused(folders, tmp_path, dtype, kind):
    name = "model.layers.1.self_attn.q_proj.weight"

    def cast(tensors):
        tensors[name] = tensors[name].to(dtype)

    folder, file = _edit(folders / "untied", tmp_path / "cast", cast)
    assert _refusal(folder) == (
        f"{file}: {name!r} is {kind} dtype the loader would cast to float and train as weights; the model reads "
        f"F32, BF16, F16 only: use the unquantized weights")


def test_bf16_and_f16_weights_are_accepted(folders, tmp_path):
    for dtype in (torch.bfloat16, torch.float16):
        folder, _ = _edit(folders / "untied", tmp_path / str(dtype), lambda t: t.update(
            {k: v.to(dtype) for k, v in t.items()}))
        check_hf_weights(folder, load_hf_args(folder))


def test_an_index_naming_a_missing_shard_names_the_file(folders, tmp_path):
    folder = tmp_path / "sharded"
    shutil.copytree(folders / "sharded", folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    os.remove(folder / shards[-1])
    count = sum(1 for f in index["weight_map"].values() if f == shards[-1])
    message = _refusal(str(folder))
    assert message.startswith(f"{folder}/model.safetensors.index.json names {shards[-1]} (for {count} tensor(s), "
                              f"e.g. '") and message.endswith(
        f"which is not in {folder}; download that file again (an interrupted download?)"), message
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')  # truncated
    assert _refusal(str(folder)).startswith(f"{folder}/model.safetensors.index.json is not a readable index "
                                            f"(JSONDecodeError: ")


def test_a_file_beside_the_index_is_not_the_models_unless_it_clashes(folders, tmp_path):
    """Mistral's repositories ship consolidated.safetensors (its own names) beside the sharded files:
    transformers reads only what the index names, and so does the check; a clashing name is refused."""
    from safetensors.torch import save_file

    folder = tmp_path / "sharded"
    shutil.copytree(folders / "sharded", folder)
    save_file({"layers.0.attention.wq.weight": torch.zeros(64, 64)}, str(folder / "consolidated.safetensors"))
    check_hf_weights(str(folder), load_hf_args(str(folder)))
    save_file({"model.norm.weight": torch.zeros(64)}, str(folder / "consolidated.safetensors"))
    assert _refusal(str(folder)) == (
        f"{folder}/consolidated.safetensors, which model.safetensors.index.json does not name, holds "
        f"'model.norm.weight' too (the loader reads every *.safetensors file of the folder): move it out of {folder}")
