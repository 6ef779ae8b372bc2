"""The evaluation settings (the `evaluate` config group, configs/evaluate/default.yaml), checked once.

One frozen dataclass holds every key, so the group can move into the typed run configuration as it
is; `EvalSettings.from_config` checks the values and raises ValueError with one line naming the key
and what would be valid. `python -m train.evaluate` turns that into exit code 2.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from train.evaluation.tasks import TASKS


@dataclass(frozen=True)
class EvalSettings:
    tasks: tuple[str, ...] = ("lambada",)  # names from train/evaluation/tasks.py: TASKS
    data_dir: str | None = None  # local files <data_dir>/<task>/<split>.jsonl; None: the Hub via datasets
    num_fewshot: int = 0  # k solved examples before each item
    fewshot_seed: int = 1234  # which examples (train/evaluation/fewshot.py)
    limit: int | None = None  # score only the first `limit` items of each task; None: all
    batch_tokens: int = 8192  # input tokens per forward pass (train/evaluation/scorer.py)
    checkpoint: str | None = None  # python -m train.evaluate: a run directory, its checkpoints/ or one step folder
    output: str | None = None  # python -m train.evaluate: also write the results as JSON here

    @classmethod
    def from_config(cls, section: Mapping, prefix: str = "evaluate") -> "EvalSettings":
        """The settings from a mapping of the keys above (an OmegaConf section or a dict), checked."""
        values = {f.name: section[f.name] for f in fields(cls) if f.name in section}
        tasks = values.get("tasks", cls.tasks)
        if isinstance(tasks, str) or not all(isinstance(t, str) for t in tasks) or not len(tasks):
            raise ValueError(f"{prefix}.tasks={tasks!r}: must be a non-empty list of task names, from {sorted(TASKS)}")
        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"{prefix}.tasks: unknown task {unknown[0]!r}; the tasks are {sorted(TASKS)}")
        values["tasks"] = tuple(tasks)
        for key, smallest in (("num_fewshot", 0), ("fewshot_seed", 0), ("limit", 1), ("batch_tokens", 1)):
            value = values.get(key, getattr(cls, key))
            if (value is not None or key != "limit") and (
                    not isinstance(value, int) or isinstance(value, bool) or value < smallest):
                raise ValueError(f"{prefix}.{key}={value!r}: must be an integer ≥ {smallest}"
                                 + (" or null (all items)" if key == "limit" else ""))
        for key in ("data_dir", "checkpoint", "output"):
            value = values.get(key)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{prefix}.{key}={value!r}: must be a path (a string) or null")
        return cls(**values)
