"""A list of tasks, prepared once and scored with this rank's part of the model: the one entry point
for `python -m train.evaluate` and for scoring during training.

    tasks = prepare_tasks(settings, model_cfg.seq_len)            # once; no model needed
    metrics = evaluate_tasks(part, model_cfg, topology, tasks, settings.batch_tokens, bf16)
    # {"eval/lambada/acc": …, "eval/lambada/ppl": …, "eval/hellaswag/acc": …, "eval/hellaswag/acc_norm": …}

`prepare_tasks` loads each task (train/evaluation/tasks.py), keeps the first `limit` items, adds the
k-shot examples (train/evaluation/fewshot.py) and encodes the requests (train/evaluation/requests.py).
`evaluate_tasks` is called by every rank of the layout together; it scores all tasks' requests in one
pass (train/evaluation/scorer.py) and returns the same dict on every rank, the same at every layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from model import GPTConfig
from train.config.sections.evaluate import EvaluateConfig
from train.evaluation.fewshot import with_examples
from train.evaluation.items import Item
from train.evaluation.requests import TokenRequest, tokenize
from train.evaluation.scorer import Score, score_requests
from train.evaluation.task_metrics import task_metrics
from train.evaluation.tasks import TASKS, TaskError, check_task_names, load_split


@dataclass(frozen=True)
class PreparedTask:
    name: str
    items: tuple[Item, ...]  # with their k-shot examples
    requests: tuple[tuple[TokenRequest, ...], ...]  # per item, one per choice
    skipped: int  # malformed records of the scored split
    truncated: int  # requests whose context was cut from the left to fit model.seq_len
    source: str


@dataclass(frozen=True)
class TaskResult:
    task: PreparedTask
    metrics: dict[str, float]
    scores: list[list[Score]]  # per item, per choice


def prepare_tasks(settings: EvaluateConfig, seq_len: int) -> list[PreparedTask]:
    """Every task of `settings`, ready to score (TaskError: unknown task, missing file, no usable record)."""
    check_task_names(settings.tasks)
    data_dir = None if settings.data_dir is None else Path(settings.data_dir)
    return [_prepare(name, settings, data_dir, seq_len) for name in settings.tasks]


def _prepare(name: str, settings: EvaluateConfig, data_dir: Path | None, seq_len: int) -> PreparedTask:
    spec = TASKS[name]
    scored = load_split(name, spec.split, data_dir)
    items = scored.items[: settings.limit]
    if settings.num_fewshot:
        same = spec.fewshot_split is None
        pool = scored.items if same else load_split(name, spec.fewshot_split, data_dir).items
        try:
            items = with_examples(items, pool, settings.num_fewshot, settings.fewshot_seed, same)
        except ValueError as err:
            raise TaskError(f"{name}: {err}") from None
    flat, truncated = tokenize([request for item in items for request in item.requests], seq_len)
    requests, start = [], 0
    for item in items:
        requests.append(tuple(flat[start : start + len(item.requests)]))
        start += len(item.requests)
    return PreparedTask(name, items, tuple(requests), scored.skipped, truncated, scored.source)


def score_tasks(part, config: GPTConfig, topology, tasks: list[PreparedTask], batch_tokens: int,
                bf16: bool = False) -> list[TaskResult]:
    """Every task's metrics and per-request scores (all ranks together; the same on every rank)."""
    flat = [request for task in tasks for item_requests in task.requests for request in item_requests]
    scores = iter(score_requests(part, config, topology, flat, batch_tokens, bf16))
    results = []
    for task in tasks:
        per_item = [[next(scores) for _ in item_requests] for item_requests in task.requests]
        results.append(TaskResult(task, task_metrics(TASKS[task.name].kind, task.items, per_item), per_item))
    return results


def evaluate_tasks(part, config: GPTConfig, topology, tasks: list[PreparedTask], batch_tokens: int,
                   bf16: bool = False) -> dict[str, float]:
    """{f"eval/{task}/{metric}": value} of every task (see the module docstring)."""
    return {f"eval/{r.task.name}/{metric}": value
            for r in score_tasks(part, config, topology, tasks, batch_tokens, bf16) for metric, value in r.metrics.items()}
