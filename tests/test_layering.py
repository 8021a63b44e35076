"""The package's layers, read from the import statements of its files (function-local imports too):
``config/`` is a leaf, nothing inside the packages but the commands (``train.py``, ``tools/``) imports the trainer or the pre-flight module, the
decoder and its families import nothing distributed, ``distributed/`` nothing of ``models/`` (the contracts sit in ``ops/``), and the memory planner (``planning/``) sits beside the packages a step runs, not under them: it may use them, they
never use it, and a launch imports it only when a start-up check or the dry run asks for it."""

import ast
import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "titan_ulysses")


def imported(path: str) -> set[str]:
    """Every ``titan_ulysses`` module a file imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n.startswith("titan_ulysses")}


def files(folder: str = "") -> list[str]:
    return sorted(glob.glob(os.path.join(PACKAGE, folder, "**", "*.py"), recursive=True))


def test_config_imports_nothing_else_of_ours():
    assert len(files("config")) >= 5
    for path in files("config"):
        others = {n for n in imported(path) if not n.startswith("titan_ulysses.config")}
        assert not others, f"{os.path.relpath(path, ROOT)} imports {sorted(others)}; config/ must stay a leaf"


def test_no_package_module_imports_the_trainer_or_the_preflight():
    """Above them only the commands: ``train.py`` (the training command) and ``tools/`` (the other commands)."""
    top = {os.path.join(PACKAGE, name) for name in ("trainer.py", "preflight.py", "train.py")} | set(files("tools"))
    assert len(files("tools")) >= 8
    for path in files():
        if path in top:
            continue
        above = {n for n in imported(path) if n.split(".")[1] in ("trainer", "preflight")}
        assert not above, f"{os.path.relpath(path, ROOT)} imports {sorted(above)}, which sit above the packages"


def test_the_check_sees_function_local_imports(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("def f():\n    from titan_ulysses.models.resolve import model_args\n")
    assert imported(str(sample)) == {"titan_ulysses.models.resolve", "titan_ulysses.models.resolve.model_args"}


def test_the_decoder_and_the_families_are_not_distributed():
    """``models/decoder/`` computes the model and nothing else (gpt-fast style): only ``parallelize.py`` lays it out
    on the mesh; a family's file declares what differs and imports nothing distributed either."""
    found = files(os.path.join("models", "decoder")) + files(os.path.join("models", "families"))
    assert len(found) >= 12
    for path in found:
        if os.path.basename(path) == "parallelize.py":
            continue
        dist = {n for n in imported(path) if n.startswith("titan_ulysses.distributed")}
        assert not dist, f"{os.path.relpath(path, ROOT)} imports {sorted(dist)}; parallelism belongs in parallelize.py"


def test_distributed_imports_nothing_of_the_models():
    """What ``distributed/`` needs of a model is a contract both import from ``ops/`` (``ops/attention/contracts.py``,
    ``ops/routed_experts.py``, ``ops/layer_stats.py``): base classes, whose ``isinstance`` answers alike on every
    Python, never a model's own classes."""
    assert len(files("distributed")) >= 15
    for path in files("distributed"):
        models = {n for n in imported(path) if n.startswith("titan_ulysses.models")}
        assert not models, f"{os.path.relpath(path, ROOT)} imports {sorted(models)}; put the contract in ops/"


def test_the_step_sits_above_models_and_distributed():
    """``step.py`` (``forward_backward``, the loss convention, the non-finite guard) uses ``models/`` and
    ``distributed/``; no package below it imports it back."""
    below = ("config", "ops", "distributed", "models", "data", "interop", "checkpoint", "runs", "metrics")
    paths = [p for folder in below for p in files(folder)]
    assert len(paths) > 50
    for path in paths:
        step = {n for n in imported(path) if n.split(".")[1] == "step"}
        assert not step, f"{os.path.relpath(path, ROOT)} imports {sorted(step)}, which sits above it"


STEP_TIME = ("config", "models", "distributed", "ops", "data", "checkpoint", "interop", "runs", "metrics", "integrations")
"""The packages a training step runs (and ``optim.py``, ``heldout.py``, ``step.py``)."""
PLANNING_USES = {"config", "models", "distributed", "ops", "data", "checkpoint", "interop", "metrics", "optim", "step",
                 "planning"}
"""What the planner may import: the packages whose behaviour it models or reads (metrics: the FLOP count the
step-time model divides by its rates), and itself."""


def test_no_step_time_module_imports_the_planner():
    paths = [p for folder in STEP_TIME for p in files(folder)]
    paths += [os.path.join(PACKAGE, name) for name in ("optim.py", "heldout.py", "step.py")]
    assert len(paths) > 50
    for path in paths:
        planner = {n for n in imported(path) if n.startswith("titan_ulysses.planning")}
        assert not planner, f"{os.path.relpath(path, ROOT)} imports {sorted(planner)}: the step must not need the planner"


def test_the_planner_imports_only_what_it_models():
    assert len(files("planning")) >= 8
    for path in files("planning"):
        others = {n for n in imported(path) if n.split(".")[1] not in PLANNING_USES}
        assert not others, (f"{os.path.relpath(path, ROOT)} imports {sorted(others)}; planning/ may import only "
                            f"{sorted(PLANNING_USES)}")


def test_a_launch_loads_the_planner_only_when_asked():
    """Importing the trainer (and with it the pre-flight checks) loads no planning/ module: the start-up memory
    warning and the dry run import it where they run."""
    code = ("import sys, titan_ulysses.trainer, titan_ulysses.preflight; "
            "print(sorted(m for m in sys.modules if m.startswith('titan_ulysses.planning')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"importing the trainer loaded {out.stdout.strip()}"


def module_of(path: str) -> str:
    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return name.removesuffix(".__init__")


def import_graph(paths: list[str]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (at any depth of its code): each imported name resolved to the
    longest module it names (``from a.b import c`` is ``a.b.c`` when c is a module, else ``a.b``)."""
    modules = {module_of(p): p for p in paths}

    def owner(name: str) -> str | None:
        parts = name.split(".")
        return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), None)

    def targets(path: str) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names |= {f"{node.module}.{a.name}" for a in node.names}
        return {n for n in names if n.startswith("titan_ulysses")}

    return {m: {o for n in targets(p) if (o := owner(n)) not in (None, m)} for m, p in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root), on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w), on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


ALLOWED_CIRCLES: dict[frozenset, str] = {}
"""Circles that may stay, each with the reason. Empty is the aim."""


def test_no_import_circle_among_the_package_modules():
    """No module of the package reaches back, directly or through others, to one that imports it: each file
    reads from the bottom up (function-level imports count: they hide a circle, they do not break it)."""
    graph = import_graph(files())
    assert len(graph) > 150
    found = [c for c in circles(graph) if frozenset(c) not in ALLOWED_CIRCLES]
    assert not found, "import circles: " + "; ".join(
        " <-> ".join(m.removeprefix("titan_ulysses.") for m in c) for c in found)


def test_the_circle_check_finds_a_circle_held_by_a_function_level_import(tmp_path):
    package = tmp_path / "titan_ulysses"
    package.mkdir()
    (package / "a.py").write_text("from titan_ulysses.b import f\n")
    (package / "b.py").write_text("def f():\n    from titan_ulysses.c import g\n")
    (package / "c.py").write_text("import titan_ulysses.a\n")
    (package / "d.py").write_text("from titan_ulysses import a\n")
    paths = [str(package / f"{m}.py") for m in "abcd"]
    global ROOT
    root, ROOT = ROOT, str(tmp_path)
    try:
        assert circles(import_graph(paths)) == [["titan_ulysses.a", "titan_ulysses.b", "titan_ulysses.c"]]
    finally:
        ROOT = root


def test_the_model_registry_imports_no_family_and_the_decoder_no_registry():
    """Families register themselves into ``models/registry.py``; ``models/__init__.py`` imports them once.
    The decoder builds what it is given (``build_model`` passes the family's spec)."""
    registry = imported(os.path.join(PACKAGE, "models", "registry.py"))
    assert not {n for n in registry if n.startswith("titan_ulysses.models.families")}, sorted(registry)
    for path in files(os.path.join("models", "decoder")):
        up = {n for n in imported(path) if n.startswith(("titan_ulysses.models.registry", "titan_ulysses.models.families"))}
        assert not up, f"{os.path.relpath(path, ROOT)} imports {sorted(up)}: the decoder does not look families up"
