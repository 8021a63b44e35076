"""The docs name only what the code has: settings, flags, choices, families, files and links.

Every `section.key` / `--section.key` in README.md and docs/ is a JobConfig field; every value the docs
give a setting with a fixed set of values is one of them; every `--flag` of a script is one its source
accepts; the model families, RoPE types and attention backends the docs list are registered; every file
path and relative link resolves; the README's code map matches the tree; and no page outgrows its size.
Each checker returns the problems it finds, so a planted wrong name shows that it would fail.
"""

import dataclasses
import glob
import os
import re
import subprocess

import pytest

from titan_ulysses.config.job_config import CHOICES, JobConfig
from titan_ulysses.distributed.activation_checkpoint import AC_MODES
from titan_ulysses.models.extension import METHODS
from titan_ulysses.models.registry import FAMILIES, get_family
from titan_ulysses.models.rope import REFUSED, ROPE_TYPES
from titan_ulysses.ops.attention.registry import BACKENDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX, PAGE_MAX = 12 * 1024 + 512, 10 * 1024 + 512  # "about 12 KB" and "about 10 KB" (issue 32)

# Pages that other branches are adding; the README links them ahead of their merge. The lead removes
# each name here once its branch is merged (then a broken link to it fails like any other).
NOT_YET_MERGED: set[str] = set()

# `--flags` of programs that are not ours (launchers, downloaders, schedulers).
EXTERNAL_FLAGS = {
    "--nproc-per-node", "--nnodes", "--rdzv-id", "--rdzv-backend", "--rdzv-endpoint", "--standalone",
    "--signals-to-handle", "--module",  # torchrun, torchtitan.train
    "--local-dir", "--include",  # huggingface-cli download
    "--nodes", "--gpus-per-node", "--time",  # sbatch
    "--index-url", "--no-index", "--no-deps", "--no-compile", "--upgrade", "--target",  # pip
}
# section.xxx words that are file names, not settings (`metrics.jsonl`, `float8.py`, `model.safetensors`).
FILE_SUFFIXES = {"py", "sh", "md", "toml", "json", "jsonl", "txt", "parquet", "png", "safetensors", "jinja"}
# Wrong names the docs quote on purpose: the troubleshooting table shows the refusal of this typo.
QUOTED_TYPOS = {"training.seq_lenn"}
# Placeholder paths the docs use for "your file".
PLACEHOLDER_PATHS = {"train_configs/X.toml", "models/families/X.py", "train_configs/<config>"}

SECTIONS = {f.name: f.type for f in dataclasses.fields(JobConfig)}


def doc_files() -> list[str]:
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                                recursive=True))


def read(path: str) -> str:
    return open(os.path.join(ROOT, path)).read()


def setting_names(text: str) -> set[str]:
    """`section.key` inside backticks, and --section.key anywhere, for every JobConfig section."""
    sections = "|".join(SECTIONS)
    pattern = rf"(?<![\w./-])(?:--)?((?:{sections})\.[a-z_0-9]+)(?![\w-]|\.[a-z])"
    names = set(re.findall(rf"--((?:{sections})\.[a-z_0-9]+)", text))
    for span in re.findall(r"`([^`\n]+)`", text):
        names |= set(re.findall(pattern, span))
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        names |= set(re.findall(pattern, block))
    return {n for n in names if n.split(".")[1] not in FILE_SUFFIXES}


def unknown_settings(text: str) -> list[str]:
    fields = {f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(getattr(JobConfig(), s))}
    return sorted(name for name in setting_names(text) if name not in fields and name not in QUOTED_TYPOS)


def wrong_choices(text: str) -> list[str]:
    """Values the docs give a setting of CHOICES: `--key value`, `key = "value"`, `key = value`."""
    problems = []
    for key, allowed in CHOICES.items():
        k = re.escape(key)
        for value in re.findall(rf"--{k}[ =]+[\"']?([\w,.-]+)", text) + \
                re.findall(rf"(?<![\w.]){k} = \"?([\w,.-]*)\"?", text):
            if value not in allowed:
                problems.append(f"{key} {value!r} is not one of {allowed}")
    return problems


def script_flags(path: str) -> set[str]:
    """The --flags a program's source spells out; one that reads its settings through load_config (or
    train.py's parser) also takes --config (config/manager.py)."""
    source = read(path)
    wrapped = re.search(r"^from (titan_ulysses\.[\w.]+) import \*", source, flags=re.M)
    if wrapped:  # a wrapper of the installed command's module: its flags are there
        source = read(os.path.join(*wrapped.group(1).split(".")) + ".py")
    flags = set(re.findall(r"[\"'](--[a-z][a-z0-9-]*)[\"']", source))
    return flags | ({"--config"} if re.search(r"load_config|config_argv|\bmanager\b", source) else set())


def unknown_flags(text: str) -> list[str]:
    """A --flag after `scripts/NAME.py` (or train.py) must be that program's; any other must be someone's."""
    programs = {p: script_flags(p) for p in ["train.py", *(os.path.relpath(s, ROOT) for folder in ("scripts", "examples")
                                                          for s in glob.glob(os.path.join(ROOT, folder, "*.py")))]}
    everyone = set().union(*programs.values()) | EXTERNAL_FLAGS
    problems = []
    text = re.sub(r"\\\n\s*", " ", text)  # continued command lines
    for line in text.splitlines():
        for program, rest in re.findall(r"((?:scripts/)?[\w]+\.py)\b([^`|]*)", line):
            own = programs.get(program) or programs.get(f"scripts/{program}") or programs.get(f"examples/{program}")
            if own is None:
                continue
            rest = re.split(r"\s(?:torchrun|python3?|&&|\|)\s", rest)[0]
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?![\w.-])", rest):
                if flag not in own and flag not in EXTERNAL_FLAGS and flag != "--help":
                    problems.append(f"{program} has no {flag}")
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?![\w.-])", line):
            if flag not in everyone and flag != "--help":
                problems.append(f"no program here has {flag}")
    return sorted(set(problems))


def unknown_families(text: str) -> list[str]:
    """The families table's `(model_type)`s are registered, and every registered family is in it."""
    get_family("llama")  # registers them all
    rows = re.findall(r"^\|([^|]*)\|", text, flags=re.M)
    named = {n for cell in rows if "model_type" not in cell for n in re.findall(r"\(`(\w+)`\)", cell)}
    return sorted([f"family {n!r} is not registered" for n in named - set(FAMILIES)] +
                  [f"family {n!r} is not on the page" for n in set(FAMILIES) - named])


def unknown_rope_types(text: str) -> list[str]:
    para = re.search(r"^RoPE types:(.*?)(?:\n\n|$)", text, flags=re.M | re.S)
    named = set(re.findall(r"`(\w+)`", para.group(1))) if para else set()
    return sorted(f"RoPE type {n!r} is neither computed nor refused" for n in named - set(ROPE_TYPES) - set(REFUSED))


def unknown_backends(text: str) -> list[str]:
    """The rows of a table headed by `model.attn_backend` name registered backends."""
    problems = []
    for table in re.findall(r"^\| `model\.attn_backend` \|.*?\n((?:\|.*\n)+)", text, flags=re.M):
        for name in re.findall(r"^\| `(\w+)`", table, flags=re.M):
            if name not in BACKENDS:
                problems.append(f"attention backend {name!r} is not registered")
    return problems


def repo_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    return out or [os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(ROOT) for f in fs]


def missing_paths(text: str, files: list[str]) -> list[str]:
    """Backticked `dir/file.py|.sh|.toml` (also relative to a package, as `models/registry.py`) exist."""
    problems = []
    for span in re.findall(r"`([^`\n]+)`", text):
        for path in re.findall(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:py|sh|toml))(?![\w-])", span):
            if path in PLACEHOLDER_PATHS or "*" in path or path.startswith("outputs/"):  # outputs: the commands' own
                continue
            if not any(f == path or f.endswith("/" + path) for f in files):
                problems.append(f"no file {path}")
    return sorted(set(problems))


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(path: str, text: str) -> list[str]:
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if resolved in NOT_YET_MERGED:
            continue
        full = os.path.join(ROOT, resolved)
        if not os.path.exists(full):
            problems.append(f"{path}: link to missing {target}")
        elif anchor and full.endswith(".md"):
            if anchor not in {slug(h) for h in re.findall(r"^#+ (.*)$", open(full).read(), flags=re.M)}:
                problems.append(f"{path}: no heading #{anchor} in {resolved}")
    return problems


def test_no_page_outgrows_its_size():
    assert len(read("README.md").encode()) <= README_MAX
    for path in doc_files()[1:]:
        assert len(read(path).encode()) <= PAGE_MAX, f"{path}: {len(read(path).encode())} bytes"


def test_the_registries_and_the_settings_choices_agree():
    """The docs are checked against CHOICES; CHOICES must be what the registries run."""
    assert tuple(CHOICES["model.attn_backend"]) == tuple(BACKENDS)
    assert tuple(CHOICES["activation_checkpoint.mode"]) == tuple(AC_MODES)
    assert set(CHOICES["model.rope_scaling_type"]) - {""} == set(METHODS)


@pytest.mark.parametrize("path", doc_files())
def test_docs_name_only_what_the_code_has(path):
    text, files = read(path), repo_files()
    problems = (unknown_settings(text) + wrong_choices(text) + unknown_flags(text) + unknown_backends(text)
                + missing_paths(text, files) + broken_links(path, text))
    assert not problems, "\n".join(problems)


def test_the_families_page_lists_the_registry():
    text = read("docs/model_families.md")
    assert not unknown_families(text) + unknown_rope_types(text)


def test_the_code_map_matches_the_tree():
    text = read("README.md")
    code_map = text.split("\n## Code map\n", 1)[1].split("\n## ", 1)[0]
    problems, named = [], set()
    for row in re.findall(r"^\| (.*?) \| (.*) \|$", code_map, flags=re.M)[2:]:
        heads = re.findall(r"`([^`]+)`", row[0])
        named |= set(heads)
        for head in heads:
            if not os.path.exists(os.path.join(ROOT, head)):
                problems.append(f"code map: no {head}")
        bases = [h for h in heads if h.endswith("/")] or [""]
        for name in re.findall(r"`([\w*./-]+\.(?:py|sh)|[\w-]+/)`", row[1]):
            if not any(glob.glob(os.path.join(ROOT, base, name)) for base in [*bases, ""]):
                problems.append(f"code map: no {name} under {bases}")
            named |= {base + name for base in bases}
    package = os.path.join(ROOT, "titan_ulysses")
    for entry in sorted(os.listdir(package)):  # every package and top-level module of the library
        if entry.startswith("__") or not (entry.endswith(".py") or os.path.isdir(os.path.join(package, entry))):
            continue
        want = f"titan_ulysses/{entry}" + ("/" if os.path.isdir(os.path.join(package, entry)) else "")
        if want not in named:
            problems.append(f"code map: {want} is not named")
    for sub in ("models/decoder/", "models/families/", "models/moe/", "ops/attention/", "metrics/loggers/"):
        if f"titan_ulysses/{sub}" not in named:
            problems.append(f"code map: titan_ulysses/{sub} is not named")
    assert not problems, "\n".join(problems)


PLANTED = """
Set `training.seq_lenn` or --parallelism.ulysses_degre 4, `model.attn_backend = "flexx"`,
`--activation_checkpoint.mode partial`, then `python scripts/plan.py --flavor 8B --gpuz 8` and
`torchrun --nproc-per-node 2 train.py --dry-runn`. See `models/families/llama4.py` and [the page](nowhere.md).

| Llama 4 (`llama4`) | -- | -- |

RoPE types: `llama3`, `ntk`.

| `model.attn_backend` | what |
|---|---|
| `ring` | not a backend |
"""


def test_a_planted_wrong_name_fails_each_check():
    assert unknown_settings(PLANTED.replace("seq_lenn", "seq_lem")) == ["parallelism.ulysses_degre",
                                                                         "training.seq_lem"]
    assert len(wrong_choices(PLANTED)) == 2
    flags = unknown_flags(PLANTED)
    assert "scripts/plan.py has no --gpuz" in flags and "train.py has no --dry-runn" in flags
    assert "family 'llama4' is not registered" in unknown_families(PLANTED)
    assert unknown_rope_types(PLANTED) == ["RoPE type 'ntk' is neither computed nor refused"]
    assert unknown_backends(PLANTED) == ["attention backend 'ring' is not registered"]
    assert missing_paths(PLANTED, repo_files()) == ["no file models/families/llama4.py"]
    assert broken_links("docs/x.md", PLANTED) == ["docs/x.md: link to missing nowhere.md"]
    # and the real pages pass the same checks (test_docs_name_only_what_the_code_has)
