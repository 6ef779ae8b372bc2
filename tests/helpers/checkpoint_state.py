"""Read every file of a checkpoint folder, for tests that compare two checkpoints value by value."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

# Entries of state.json that legitimately move on from one step to the next, skipped or not: the
# loop's counters, the data position and DeepSpeed's step counters.
COUNTERS = {"step", "tokens", "data", "engine"}


def load_folder(folder: Path) -> dict:
    """{file name: its contents} for a checkpoint folder: every tensor file, state.json and rng.json
    (the manifest only restates their sizes and checksums)."""
    folder = Path(folder)
    shards = sorted(folder.glob("*.safetensors"))
    assert shards, f"no checkpoint tensors in {folder}"
    loaded = {f.name: load_file(f) for f in shards}
    for name in ("state.json", "rng.json"):
        loaded[name] = json.loads((folder / name).read_text())
    return loaded


def differences(a, b, path: str = "", top: bool = True) -> list[str]:
    """Where two loaded checkpoint files differ, apart from COUNTERS at the top of the file."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a if not (top and k in COUNTERS) for d in differences(a[k], b[k], f"{path}/{k}", top=False)]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} and {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]", top=False)]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [f"{path}: tensors differ"]
    if type(a) is type(b) and hasattr(a, "__dict__") and type(a).__eq__ is object.__eq__:  # e.g. a loss scaler
        return differences(vars(a), vars(b), path, top=False)
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def states_differ(folder_a: Path, folder_b: Path) -> list[str]:
    """Differences between two checkpoints' state (weights, Adam moments and step count, LR schedule),
    apart from COUNTERS and the RNG states, which move on with every step."""
    a, b = load_folder(folder_a), load_folder(folder_b)
    assert set(a) == set(b), (sorted(a), sorted(b))
    return [d for name in a if name != "rng.json" for d in differences(a[name], b[name], name)]


def non_finite_tensors(folder: Path) -> list[str]:
    """Paths of floating-point tensors (weights, moments) holding inf or nan, in every file of a folder."""
    found = []

    def walk(value, path):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}/{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")
        elif isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
            found.append(path)

    for name, content in load_folder(folder).items():
        walk(content, name)
    return found


class NoLogger:
    """A metrics logger that logs no checkpoint artifact."""

    def checkpoint(self, path: Path, step: int) -> None:
        pass


def save_checkpoint(trainer) -> None:
    """The run's save of the step it stands at, as its last step (written before this returns), with the
    loop's safeguards around it (they refuse non-finite weights)."""
    from train.guard.safeguards import Safeguards

    guard = Safeguards(trainer.spec.sections.train, trainer.run_dir, trainer.engine, trainer.topology.rank, print)
    try:
        trainer.checkpointer.connect(guard, NoLogger())
        trainer.checkpointer.save(trainer.progress.step, last=True)
    finally:
        guard.close()
