"""``train.py --help [SECTION]``: every section's (or one section's) keys with their defaults and docstrings, read
from job_config.py; a bare ``train.py`` prints the usage and the shipped configs."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import sys
import textwrap

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

from titan_ulysses.config import job_config
from titan_ulysses.config.job_config import CHOICES, JobConfig
from titan_ulysses.config.shipped import CONFIG_DIR, shipped_configs

USAGE = """usage: torchrun --nproc-per-node N train.py --config X [--section.key value ...]
       torchrun --nproc-per-node N -m titan_ulysses.train --config X [...]   (titan-train: one process)
       python train.py --config X --dry-run --world-size N [--device-memory-gib G] [...]
       python train.py --help [SECTION]

X is a TOML file or a shipped config's name (below). Settings come from its [section] tables;
--section.key value (or --section.key=value) overrides one on the command line. Paths in a config
(job.dump_folder, ./data, ./assets) are relative to the working directory. --dry-run makes every check
a launch on N ranks makes, without starting it, and prints the plan (exit 0) or the one-line refusal (exit 2).
"""


def field_docs() -> dict[str, dict[str, str]]:
    """class name -> field name -> the docstring under the field (attribute docstrings are not kept at runtime),
    read from job_config.py and the module of every section or table defined in a file of its own."""
    docs: dict[str, dict[str, str]] = {}
    nodes = [node for module in _section_modules() for node in ast.parse(inspect.getsource(module)).body]
    for node in nodes:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = docs.setdefault(node.name, {})
        for prev, item in zip(node.body, node.body[1:]):
            if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                    and isinstance(item, ast.Expr) and isinstance(item.value, ast.Constant)
                    and isinstance(item.value.value, str)):
                fields[prev.target.id] = inspect.cleandoc(item.value.value)
    return docs


def _section_modules() -> list:
    """job_config and the modules of the dataclasses reachable from JobConfig (e.g. hf_dataset.py)."""
    modules, todo, seen = [job_config], [JobConfig], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        module = sys.modules[cls.__module__]
        if module not in modules:
            modules.append(module)
        todo += [f.default_factory for f in dataclasses.fields(cls) if dataclasses.is_dataclass(f.default_factory)]
    return modules


def _description(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return str(tomllib.load(f).get("job", {}).get("description", ""))
    except (OSError, tomllib.TOMLDecodeError):
        return ""


def shipped_lines() -> str:
    """The shipped configs, each with its ``job.description``."""
    shipped = shipped_configs()
    width = max(map(len, shipped), default=0)
    return f"shipped configs (--config NAME; the files: {os.path.realpath(CONFIG_DIR)}):\n" + "\n".join(
        f"  {name:<{width}}  {_description(path)}" for name, path in shipped.items())


def usage() -> str:
    sections = ", ".join(f.name for f in dataclasses.fields(JobConfig))
    return f"{USAGE}\n{shipped_lines()}\n\nsections (--help SECTION): {sections}\n"


def help_command(argv: list[str]) -> int | None:
    """What ``train.py`` prints instead of running: ``--help [SECTION]`` (exit 0; an unknown section is one
    line, exit 2), no argument at all (the usage and the shipped configs, exit 2); None: run."""
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    flags = [i for i, a in enumerate(argv) if a in ("-h", "--help")]
    if not flags:
        return None
    after = argv[flags[0] + 1] if flags[0] + 1 < len(argv) else ""
    section = "" if after.startswith("-") else after
    sections = [f.name for f in dataclasses.fields(JobConfig)]
    if section and section not in sections:
        print(f"--help {section}: no such section; sections: {', '.join(sections)}", file=sys.stderr)
        return 2
    print(format_help(only=section))
    return 0


def format_help(width: int = 100, only: str = "") -> str:
    """Every section's keys after the usage and the shipped configs, or section ``only``'s alone."""
    docs = field_docs()
    config = JobConfig()
    lines = [] if only else [usage(), "Sections and keys, with their defaults:"]
    for section in [f for f in dataclasses.fields(config) if not only or f.name == only]:
        obj = getattr(config, section.name)
        lines.append(f"[{section.name}]")
        for key, owner, name in _keys(section.name, obj):
            default = getattr(owner, name)
            named = [repr(c) if c == "" else str(c) for c in CHOICES.get(key, ())]  # '' (unset) shows as ''
            choices = f" (one of {', '.join(named)})" if named else ""
            lines.append(f"  --{key} {default!r}{choices}")
            doc = " ".join(docs.get(type(owner).__name__, {}).get(name, "").split())
            if doc:
                lines.extend(textwrap.wrap(doc, width, initial_indent="      ", subsequent_indent="      "))
        lines.append("")
    return "\n".join(lines)


def _keys(prefix: str, obj):
    """(section.key, the object holding it, its name) for every key, a table's keys in its place."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _keys(f"{prefix}.{f.name}", value)
        else:
            yield f"{prefix}.{f.name}", obj, f.name
