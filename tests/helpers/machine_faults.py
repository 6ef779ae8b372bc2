"""The environment that makes a `python -m train` meet machine faults (tests/helpers/faults/sitecustomize.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

HOOK = Path(__file__).resolve().parent / "faults"


def fault_env(**faults) -> dict:
    """Environment variables that inject `faults` (the keys of tests/helpers/faults/sitecustomize.py:
    disk, read_only, unreadable, log) into the process and the processes it starts."""
    path = os.pathsep.join(p for p in (str(HOOK), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "GPT3D_TEST_FAULTS": json.dumps(faults)}


def injected(log: Path) -> list[tuple[str, str]]:
    """The faults the hook injected, in order: (errno name, path) each."""
    if not Path(log).exists():
        return []
    return [tuple(line.split(" ", 1)) for line in Path(log).read_text().splitlines()]
