"""The run state a checkpoint holds besides the tensors: parts registered once, saved and loaded alike.

Each part is a pair of functions that a run registers when it builds (train/loop.py): `save()` returns
a dict of JSON-able entries, `load(state)` takes them back from the dict the checkpoint read. Shared
parts (the same on every rank: progress, data position, LR schedule, schedule record, DeepSpeed's step
counters) are merged into state.json, each under its own top-level keys; per-rank parts (the RNG) are
merged into that rank's entry of rng.json. Saving and loading walk the same list in the same order,
so what is saved is exactly what is loaded, and nothing reaches into the engine to find it.

A part with no `load` is a record only: it is read back before the build, from state.json itself (the
schedule record, train/checkpoint/resume_checks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# state.json keys the checkpoint writes itself (its identity and the optimizer's tensor-side state)
CORE_KEYS = frozenset({"format", "format_version", "gpt3d", "layout", "model", "optimizer"})


@dataclass(frozen=True)
class Part:
    name: str
    save: Callable[[], dict]
    load: Callable[[dict], None] | None
    per_rank: bool


class CheckpointParts:
    """The registered parts of one run, in registration order."""

    def __init__(self):
        self._parts: list[Part] = []

    def add(self, name: str, save: Callable[[], dict], load: Callable[[dict], None] | None, *,
            per_rank: bool = False) -> None:
        if any(part.name == name for part in self._parts):
            raise ValueError(f"checkpoint part {name!r} is registered twice")
        self._parts.append(Part(name, save, load, per_rank))

    def saved(self, per_rank: bool = False) -> dict:
        """Every shared (or per-rank) part's entries, merged; a key two parts (or the checkpoint
        itself) claim is a ValueError. Every rank calls it: a part's save may be a collective."""
        merged, owner = {}, {key: "the checkpoint" for key in CORE_KEYS}
        for part in self._selected(per_rank):
            for key, value in part.save().items():
                if key in owner:
                    raise ValueError(f"checkpoint part {part.name!r} saves {key!r}, which {owner[key]} saves too")
                owner[key], merged[key] = f"part {part.name!r}", value
        return merged

    def load(self, state: dict, per_rank: bool = False) -> None:
        """Give each shared (or per-rank) part back its entries of `state`."""
        for part in self._selected(per_rank):
            if part.load is not None:
                part.load(state)

    def _selected(self, per_rank: bool) -> list[Part]:
        return [part for part in self._parts if part.per_rank == per_rank]
