"""`evaluate.*`: GPT-3's zero- and few-shot tasks (docs/evaluation.md), for `python -m train.evaluate` and for
the tasks a training run scores as it goes (train.eval_tasks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from train.config.settings import Check, ConfigError, Section, setting

PATH = Check(lambda v: v is None or isinstance(v, str), "must be a path (a string) or null")
# The tasks train/evaluation/tasks.py scores (its TASKS table has exactly these)
TASK_NAMES = ("lambada", "hellaswag", "piqa", "arc_easy", "arc_challenge", "storycloze", "copa", "winogrande")


def _integer(smallest: int, null: str = "") -> Check:
    def test(value) -> bool:
        return (null and value is None) or (isinstance(value, int) and not isinstance(value, bool) and value >= smallest)

    return Check(test, f"must be an integer ≥ {smallest}" + (f" or null ({null})" if null else ""))


@dataclass
class EvaluateConfig(Section):
    """`evaluate.*` (see the module docstring)."""

    PREFIX: ClassVar[str] = "evaluate"
    checkpoint: Any = setting(None, "python -m train.evaluate: a run directory, its checkpoints/ folder (the latest "
                                    "checkpoint) or one step folder", PATH)
    tasks: Any = setting(doc=", ".join(TASK_NAMES),
                         factory=lambda: ["lambada"])
    data_dir: Any = setting(None, "local files <data_dir>/<task>/<split>.jsonl in each task's published form; null: "
                                  "the Hub through datasets", PATH)
    num_fewshot: Any = setting(0, "k solved examples from the task's train (or dev) split before each item", _integer(0))
    fewshot_seed: Any = setting(1234, "which examples: the same for every run and layout", _integer(0))
    limit: Any = setting(None, "score only the first N items of each task", _integer(1, "all items"))
    batch_tokens: Any = setting(8192, "input tokens per forward pass", _integer(1))
    output: Any = setting(None, "python -m train.evaluate: also write the metrics and every request's "
                                "log-likelihood as JSON here", PATH)

    def check(self) -> None:
        check_tasks("evaluate.tasks", self.tasks)


def check_tasks(key: str, tasks, empty_ok: bool = False) -> None:
    """`tasks` is a list of known task names (TASK_NAMES); ConfigError naming `key` if not."""
    if isinstance(tasks, str) or not isinstance(tasks, (list, tuple)) or not (tasks or empty_ok) \
            or not all(isinstance(t, str) for t in tasks):
        what = "a list" if empty_ok else "a non-empty list"
        raise ConfigError(f"{key}={tasks!r}: must be {what} of task names, from {sorted(TASK_NAMES)}")
    unknown = [name for name in tasks if name not in TASK_NAMES]
    if unknown:
        raise ConfigError(f"{key}: unknown task {unknown[0]!r}; the tasks are {sorted(TASK_NAMES)}")
