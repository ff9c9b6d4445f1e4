"""The package's import graph has floors and no circles (read from the source, nothing imported).

Every ``import`` of a module of ``hpc_asyncppo`` counts: at module level, inside a
function, under ``if TYPE_CHECKING:`` or in a ``try``. Importing ``a.b.c`` runs the
``__init__`` of ``a.b`` too, so it also counts as importing that package (unless the
importer is inside it). No module may take part in a circle, and no module may import one
of a floor above its own. The floors, from the ground up:

0. ground: what every floor may use and which knows no role: ``paths.py`` (the run
   directory's names), ``runlog.py``, ``timeline.py``, ``goodput.py`` (what a run writes
   and how to read it back), ``loss_mask.py`` (the samples' loss mask, read by both
   roles), ``transport/`` (samples rollout -> trainer and the control messages back,
   weights trainer -> rollout, and the small pieces both sides of them run:
   ``Control``, ``Background``), ``runtime/`` (what a running rank uses: topology,
   signals, heartbeats, faults), ``checkpoint/`` (the file format and the protocol, which
   names what it needs of a rank's state instead of importing its class), ``tools/``
   (tool classes and verl's tool config, which the config validates).
1. ``config/``: every knob, its loading and its checks.
2. what the roles build on: ``models/`` (the tiny model, LoRA, dtypes, safetensors
   reading), ``tasks/``, ``memory.py`` (the GPU memory estimate), ``export.py`` (a
   checkpoint as a Hugging Face folder: the trainer's last step and a CLI).
3. the roles: ``rollout/`` and ``trainer/``. They run in different processes and talk
   only through ``transport/``: neither imports the other.
4. ``launch/``: how ranks are started (mpirun, Slurm), run directories, job restarts.
5. entry points, which may import anything: ``rank.py`` (a rank's main), ``submit.py``,
   ``status.py``, ``report.py``, ``gpu_check.py``, ``eval.py`` (a checkpoint's score),
   ``cli.py`` and ``__main__.py`` (the ``hpc-asyncppo`` command).

A new module must be given a floor here (a top-level module or package not listed fails).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "hpc_asyncppo"
PACKAGE = "hpc_asyncppo"

GROUND, CONFIG, SHARED, ROLES, LAUNCH, ENTRY = range(6)
FLOOR_NAMES = ["ground", "config", "shared", "roles", "launch", "entry points"]
# The first dotted part under hpc_asyncppo (a top-level module or package) -> its floor.
FLOORS = {
    "": GROUND,  # hpc_asyncppo/__init__.py
    "paths": GROUND,
    "runlog": GROUND,
    "timeline": GROUND,
    "goodput": GROUND,
    "loss_mask": GROUND,
    "transport": GROUND,
    "runtime": GROUND,
    "checkpoint": GROUND,
    "tools": GROUND,
    "config": CONFIG,
    "models": SHARED,
    "tasks": SHARED,
    "memory": SHARED,
    "export": SHARED,
    "rollout": ROLES,
    "trainer": ROLES,
    "launch": LAUNCH,
    "rank": ENTRY,
    "submit": ENTRY,
    "status": ENTRY,
    "report": ENTRY,
    "gpu_check": ENTRY,
    "eval": ENTRY,
    "cli": ENTRY,
    "__main__": ENTRY,
}


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported_names(tree: ast.Module, importer: str, is_package: bool) -> Iterator[str]:
    """Dotted names this module imports, anywhere in it, relative imports resolved:
    ``from a.b import c`` gives ``a.b.c`` (a module, or a name defined in ``a.b``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = importer.split(".")
                package = package if is_package else package[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            yield from (f"{base}.{alias.name}" for alias in node.names)


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports: the one each import names, and the
    packages above it whose ``__init__`` runs first (those the importer is not inside)."""
    modules = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = set()
        for imported in imported_names(tree, name, path.name == "__init__.py"):
            parts = imported.split(".")
            if parts[0] != PACKAGE:
                continue
            found = [".".join(parts[:i]) for i in range(2, len(parts) + 1)]
            found = [m for m in found if m in modules]
            if not found:
                continue
            *above, named = found
            targets.add(named)
            targets.update(m for m in above if not name.startswith(m + "."))
        targets.discard(name)
        graph[name] = targets
    return graph


def floor_of(module: str) -> int | None:
    top = module.split(".")[1] if "." in module else ""
    return FLOORS.get(top)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected component of more than one module
    (Tarjan), as the path that closes it: [a, b, ..., a]."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(circle_through(v, component, graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def circle_through(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest path from ``start`` back to itself inside ``component`` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in came_from:
                    came_from[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no circle through {start}")


def test_the_graph_sees_imports_inside_functions_and_type_checking_blocks() -> None:
    graph = import_graph()
    assert "hpc_asyncppo.tasks.next_digit" in graph["hpc_asyncppo.tasks.registry"]  # in a function
    assert "hpc_asyncppo.config" in graph["hpc_asyncppo.memory"]  # under TYPE_CHECKING too
    assert "hpc_asyncppo.config.slurm" in graph["hpc_asyncppo.launch.gpus"]
    assert "hpc_asyncppo.config" in graph["hpc_asyncppo.launch.gpus"]  # its __init__ runs
    assert "hpc_asyncppo.tasks" not in graph["hpc_asyncppo.tasks.next_digit"]  # its own package


def test_every_module_has_a_floor() -> None:
    missing = sorted(m for m in import_graph() if floor_of(m) is None)
    assert not missing, f"give these a floor in FLOORS (see the docstring): {missing}"


def test_no_import_circles() -> None:
    found = cycles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_module_imports_a_floor_above_its_own() -> None:
    bad = []
    for module, targets in sorted(import_graph().items()):
        here = floor_of(module)
        for target in sorted(targets):
            there = floor_of(target)
            if here is None or there is None:
                continue  # test_every_module_has_a_floor names them
            if there > here:
                bad.append(
                    f"{module} ({FLOOR_NAMES[here]}) imports {target} ({FLOOR_NAMES[there]})"
                )
    assert not bad, "imports that run up a floor:\n" + "\n".join(bad)


def test_the_roles_do_not_import_each_other() -> None:
    bad = [
        f"{module} imports {target}"
        for module, targets in sorted(import_graph().items())
        if floor_of(module) == ROLES
        for target in sorted(targets)
        if floor_of(target) == ROLES and target.split(".")[1] != module.split(".")[1]
    ]
    assert not bad, "a role imports another role:\n" + "\n".join(bad)


def test_a_circle_is_named_by_the_path_that_closes_it() -> None:
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
