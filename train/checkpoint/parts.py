"""The run state a checkpoint holds besides the tensors: parts registered once, saved and loaded alike.

A part is an object with `state_dict()` (a dict of JSON-able entries) and `load_state_dict(state)`
(takes them back from the dict the checkpoint read), as `Progress` (train/loop.py) has them; a run
registers its parts by name when it builds. Shared parts (the same on every rank: progress, data
position, LR schedule, schedule record, DeepSpeed's step counters) are merged into state.json, each
under its own top-level keys; per-rank parts (the RNG, train/checkpoint/rng.py) are merged into that
rank's entry of rng.json. Saving and loading walk the same list in the same order, so what is saved
is exactly what is loaded, and nothing reaches into the engine to find it.

The adapters below make parts of objects whose own state is not laid out as the checkpoint keeps it:
`Keyed` puts an object's state under one key (the data position as {"data": …}), `EngineCounters`
holds DeepSpeed's step counters, and `Record` is written and never loaded back into the run (the
schedule record, read from state.json before the build by train/checkpoint/resume_checks.py).
"""

from __future__ import annotations

from typing import Protocol

from train.engine import counters, restore_counters

# state.json keys the checkpoint writes itself (its identity and the optimizer's tensor-side state)
CORE_KEYS = frozenset({"format", "format_version", "gpt3d", "layout", "model", "optimizer"})


class Part(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class CheckpointParts:
    """The registered parts of one run, in registration order."""

    def __init__(self):
        self._parts: list[tuple[str, Part, bool]] = []  # (name, part, per rank)

    def add(self, name: str, part: Part, *, per_rank: bool = False) -> None:
        """Register `part` under `name` (for messages); `per_rank`: its state is each rank's own (rng.json)."""
        if any(known == name for known, _, _ in self._parts):
            raise ValueError(f"checkpoint part {name!r} is registered twice")
        self._parts.append((name, part, per_rank))

    def saved(self, per_rank: bool = False) -> dict:
        """Every shared (or per-rank) part's entries, merged; a key two parts (or the checkpoint
        itself) claim is a ValueError. Every rank calls it: a part's state_dict may be a collective."""
        merged, owner = {}, {key: "the checkpoint" for key in CORE_KEYS}
        for name, part in self._selected(per_rank):
            for key, value in part.state_dict().items():
                if key in owner:
                    raise ValueError(f"checkpoint part {name!r} saves {key!r}, which {owner[key]} saves too")
                owner[key], merged[key] = f"part {name!r}", value
        return merged

    def load(self, state: dict, per_rank: bool = False) -> None:
        """Give each shared (or per-rank) part back its entries of `state`."""
        for _, part in self._selected(per_rank):
            part.load_state_dict(state)

    def _selected(self, per_rank: bool) -> list[tuple[str, Part]]:
        return [(name, part) for name, part, own in self._parts if own == per_rank]


class Keyed:
    """`obj`'s state under the one key `key` of the checkpoint's state."""

    def __init__(self, key: str, obj: Part):
        self.key, self.obj = key, obj

    def state_dict(self) -> dict:
        return {self.key: self.obj.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.obj.load_state_dict(state[self.key])


class EngineCounters:
    """DeepSpeed's step counters (train/engine.py: ENGINE_COUNTERS), as {"engine": {counter: value}}."""

    def __init__(self, engine):
        self.engine = engine

    def state_dict(self) -> dict:
        return counters(self.engine)

    def load_state_dict(self, state: dict) -> None:
        restore_counters(self.engine, state)


class Record:
    """Entries a checkpoint records for readers before the build (the config checks), never loaded
    back into the run."""

    def __init__(self, entries: dict):
        self.entries = entries

    def state_dict(self) -> dict:
        return self.entries

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: the run was resolved from these entries before it was built."""
