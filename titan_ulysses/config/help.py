"""``train.py --help``: every section and key with its default and docstring, read from job_config.py."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

from titan_ulysses.config import job_config
from titan_ulysses.config.job_config import CHOICES, JobConfig

USAGE = """usage: torchrun --nproc-per-node N train.py --config train_configs/X.toml [--section.key value ...]
       python train.py --config train_configs/X.toml --dry-run --world-size N [--device-memory-gib G] [...]

Settings come from the TOML file's [section] tables; --section.key value (or --section.key=value)
overrides one on the command line. --dry-run makes every check a launch on N ranks makes, without
starting it, and prints the plan (exit 0) or the one-line refusal (exit 2).
Sections and keys, with their defaults:
"""


def field_docs() -> dict[str, dict[str, str]]:
    """class name -> field name -> the docstring under the field (attribute docstrings are not kept at runtime)."""
    tree = ast.parse(inspect.getsource(job_config))
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = docs.setdefault(node.name, {})
        for prev, item in zip(node.body, node.body[1:]):
            if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                    and isinstance(item, ast.Expr) and isinstance(item.value, ast.Constant)
                    and isinstance(item.value.value, str)):
                fields[prev.target.id] = inspect.cleandoc(item.value.value)
    return docs


def format_help(width: int = 100) -> str:
    docs = field_docs()
    config = JobConfig()
    lines = [USAGE]
    for section in dataclasses.fields(config):
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
