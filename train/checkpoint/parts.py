"""The run state a checkpoint holds besides the tensors: parts registered once, saved and loaded alike.

A part is an object with `state_dict()` (a dict of JSON-able entries) and `load_state_dict(state)`
(takes them back from the dict the checkpoint read), as `Progress` (train/run/loop.py) has them; a run
registers its parts by name when it builds. Shared parts (the same on every rank: progress, data
position, LR schedule, schedule record, DeepSpeed's step counters) are merged into state.json, each
under its own top-level keys; per-rank parts (the RNG, train/checkpoint/rng.py) are merged into that
rank's entry of rng.json. Saving and loading walk the same list in the same order, so what is saved
is exactly what is loaded, and nothing reaches into the engine to find it.

The adapters below make parts of objects whose own state is not laid out as the checkpoint keeps it:
`Keyed` puts an object's state under one key (the data position as {"data": …}), `EngineCounters`
holds DeepSpeed's step counters, and `Record` is written and never loaded back into the run (the
schedule record, read from state.json before the build by train/run/schedule.py).
"""

from __future__ import annotations

from typing import Protocol

# state.json keys the checkpoint writes itself (its identity and the optimizer's tensor-side state)
CORE_KEYS = frozenset({"format", "format_version", "gpt3d", "layout", "model", "optimizer"})
# DeepSpeed's step counters a checkpoint keeps (the engine's attributes of these names, all ints)
ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


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
    """DeepSpeed's step counters (ENGINE_COUNTERS, those the engine has), as {"engine": {counter: value}};
    only these are set back (the checkpoint's verification refuses any other name)."""

    def __init__(self, engine):
        self.engine = engine

    def state_dict(self) -> dict:
        return {"engine": {key: int(getattr(self.engine, key)) for key in ENGINE_COUNTERS if hasattr(self.engine, key)}}

    def load_state_dict(self, state: dict) -> None:
        for key in ENGINE_COUNTERS:
            if key in state["engine"]:
                setattr(self.engine, key, int(state["engine"][key]))


class Record:
    """Entries a checkpoint records for readers before the build (the config checks), never loaded
    back into the run."""

    def __init__(self, entries: dict):
        self.entries = entries

    def state_dict(self) -> dict:
        return self.entries

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: the run was resolved from these entries before it was built."""
