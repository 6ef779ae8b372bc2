"""The package structure: floors, each importing only from its own and the floors below, commands on top,
and no import circles (docs/architecture.md draws them).

Every import statement of the source tree (also those inside functions, which run later but still
tie the modules together) is read with `ast`, without importing anything. An import of `a.b` that
names a submodule (`from a.b import c`, c a module) is an edge to `a.b.c`; otherwise to `a.b`.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "parallel", "train", "launch")
# The commands (`python -m ...`): nothing imports them, and none imports another.
COMMANDS = {"train.__main__", "train.generate", "train.evaluate", "train.harness", "train.export", "train.prepare_data",
            "train.plan", "train.curves"}
# The floors, bottom to top: a module imports only modules of its own floor and the floors below.
FLOORS = (
    ("launch.local_cluster",),  # a SLURM cluster of namespaces on one machine: stands alone, imports no gpt3d
    ("model",),  # the network for one device
    ("parallel",),  # the parallel runtime: topology, sharding, stages, collectives
    ("train.config",),  # the settings: sections, their checks, the command line
    ("train.runtime", "train.monitor"),  # device, precision, process group; what observes a run
    ("train.data", "train.checkpoint", "train.guard", "train.planner", "train.evaluation"),  # the components
    ("train.run",),  # the run: resolve, checks across sections, build, loop, step, DeepSpeed's config
    tuple(sorted(COMMANDS)),  # the commands, alone at train/'s root
)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (anywhere in the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def graph() -> dict[str, set[str]]:
    modules = source_modules()
    return {name: imports(path, modules) - {name} for name, path in modules.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_finds_a_circle_and_accepts_a_tree():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_reader_sees_imports_inside_functions(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\n\ndef f():\n    from train import loop\n    from train.data import tokenizer\n")
    modules = {"train": path, "train.loop": path, "train.data": path, "train.data.tokenizer": path}
    assert imports(path, modules) == {"train.loop", "train.data.tokenizer"}


def test_no_import_circle():
    assert cycle(graph()) is None


def floor_of(name: str) -> int | None:
    """The floor a module stands on (None: a package's own __init__ above the floors, or launch/)."""
    for floor, prefixes in enumerate(FLOORS):
        if any(name == p or name.startswith(f"{p}.") for p in prefixes):
            return floor
    return None


def test_every_module_stands_on_a_floor():
    assert sorted(name for name in source_modules() if floor_of(name) is None) == ["launch", "train"]


def test_imports_run_only_down_the_floors():
    """Inside functions too: a module imports nothing from a floor above its own."""
    climbs = [f"{name} (floor {floor_of(name)}) imports {target} (floor {floor_of(target)})"
              for name, targets in graph().items() if floor_of(name) is not None
              for target in targets if floor_of(target) is not None and floor_of(target) > floor_of(name)]
    assert climbs == []


def test_the_folders_of_one_floor_import_each_other_without_a_circle():
    """On the components' floor, data, checkpoint, guard, planner and evaluation may use each other, but
    never both ways round."""
    folders = {name: next(p for p in FLOORS[4] if name == p or name.startswith(f"{p}."))
               for name in source_modules() if floor_of(name) == 4}
    edges = {folder: set() for folder in FLOORS[4]}
    for name, targets in graph().items():
        if name in folders:
            edges[folders[name]] |= {folders[t] for t in targets if t in folders and folders[t] != folders[name]}
    assert cycle(edges) is None


def test_lower_layers_never_import_higher_ones():
    """model/ imports neither parallel nor train; parallel/ never imports train."""
    higher = {"model": ("parallel", "train"), "parallel": ("train",)}
    for name, targets in graph().items():
        for layer, forbidden in higher.items():
            if name == layer or name.startswith(f"{layer}."):
                bad = sorted(t for t in targets if t.split(".")[0] in forbidden)
                assert not bad, f"{name} imports {bad}"


def test_no_module_imports_a_command():
    """The commands sit on top: no module, another command included, imports one."""
    for name, targets in graph().items():
        bad = sorted(targets & COMMANDS)
        assert not bad, f"{name} imports the command module(s) {bad}"


def test_planner_lives_in_train_plan():
    """parallel/ is runtime only: every planner module is under train/planner/."""
    modules = source_modules()
    assert not [m for m in modules if m.startswith("parallel.plan")]
    assert {"train.planner.counts", "train.planner.activations", "train.planner.comm", "train.planner.dry_run",
            "train.planner.estimate", "train.planner.search", "train.planner.hardware", "train.planner.tables"} <= set(modules)
