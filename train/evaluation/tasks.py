"""The tasks gpt3d scores, where their data comes from, and loading them (bad records skipped, counted).

Each task names its published record form (train/evaluation/formats.py), its family
(train/evaluation/items.py), the split it is scored on, the split its few-shot examples come from
(the paper's choice: the training set, or the development set where a task has none; None: the
scored split itself, leaving out the item being scored) and its copy on the Hugging Face Hub.

Data comes from local files, `<data_dir>/<task>/<split>.jsonl`, one record per line in the task's
published form, or, with no data_dir, from the Hub through `datasets` (where the network allows; where it
does not, from the local datasets cache alone, and a split that is not there is one error naming the local
files that would do).
A line that is not a JSON object, or a record that lacks what its form needs, is skipped and counted;
a task left with no item is an error, as are an unknown task and a missing file.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from train.evaluation import formats
from train.evaluation.items import CHOICE, LAST_WORD, PARTIAL, Item


class TaskError(ValueError):
    """A task that cannot be scored (unknown, missing file, no usable record); the message says why."""


@dataclass(frozen=True)
class TaskSpec:
    form: Callable[[dict], Item]
    kind: str
    split: str  # the split scored
    fewshot_split: str | None  # where k-shot examples come from; None: the scored split, minus the item
    hub: tuple[str, str | None]  # (dataset path, config name) on the Hugging Face Hub


TASKS = {
    "lambada": TaskSpec(formats.lambada, LAST_WORD, "test", None, ("EleutherAI/lambada_openai", "default")),
    "hellaswag": TaskSpec(formats.hellaswag, CHOICE, "validation", "train", ("Rowan/hellaswag", None)),
    "piqa": TaskSpec(formats.piqa, CHOICE, "validation", "train", ("baber/piqa", None)),
    "arc_easy": TaskSpec(formats.arc, CHOICE, "test", "train", ("allenai/ai2_arc", "ARC-Easy")),
    "arc_challenge": TaskSpec(formats.arc, CHOICE, "test", "train", ("allenai/ai2_arc", "ARC-Challenge")),
    "storycloze": TaskSpec(formats.storycloze, CHOICE, "test", "validation", ("LSDSem/story_cloze", "2016")),
    "copa": TaskSpec(formats.copa, CHOICE, "validation", "train", ("aps/super_glue", "copa")),
    "winogrande": TaskSpec(formats.winogrande, PARTIAL, "validation", "train", ("allenai/winogrande", "winogrande_xl")),
}


@dataclass(frozen=True)
class Split:
    """The items of one split of a task, and how many records were skipped as malformed."""

    items: tuple[Item, ...]
    skipped: int
    source: str  # the file or the Hub dataset, for messages


def check_task_names(names) -> None:
    unknown = [name for name in names if name not in TASKS]
    if unknown:
        raise TaskError(f"unknown task {unknown[0]!r}; the tasks are {sorted(TASKS)}")


def split_path(data_dir: Path, task: str, split: str) -> Path:
    return Path(data_dir) / task / f"{split}.jsonl"


def load_split(task: str, split: str, data_dir: Path | None) -> Split:
    """One split of `task`, from `<data_dir>/<task>/<split>.jsonl`, or from the Hub when data_dir is None."""
    check_task_names([task])
    spec = TASKS[task]
    if data_dir is None:
        records, source = _hub_records(task, spec, split), f"{spec.hub[0]} ({split})"
    else:
        path = split_path(data_dir, task, split)
        if not path.is_file():
            raise TaskError(f"{task}: no file {path} (the {split} split, one JSON record per line in the task's "
                            "published form)")
        records, source = _file_records(path), str(path)
    items, skipped = [], 0
    for record in records:
        try:
            if not isinstance(record, dict):
                raise TypeError("not a JSON object")
            items.append(spec.form(record))
        except (KeyError, TypeError, IndexError, ValueError, AttributeError):
            skipped += 1
    if not items:
        raise TaskError(f"{task}: {source} holds no usable record ({skipped} malformed)")
    return Split(tuple(items), skipped, source)


def _file_records(path: Path):
    """Each non-blank line decoded; a line that is not JSON comes back as None (then counted as malformed)."""
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if line.strip():
                try:
                    yield json.loads(line)
                except ValueError:
                    yield None


def _hub_records(task: str, spec: TaskSpec, split: str):
    """The split from the Hub through `datasets`; where offline mode is on or the Hub cannot be reached, from the
    local datasets cache alone, without trying (and retrying) the network. TaskError naming the local files
    that would do instead."""
    from train.data.sources import hub_offline, hub_unreachable

    path, name = spec.hub
    offline = "offline mode is on" if hub_offline() else hub_unreachable()
    if offline is not None:
        _cache_only()
    import datasets

    try:
        return datasets.load_dataset(path, name, split=split)
    except Exception as err:  # no network, no such split, a gated dataset: one line, not a traceback
        why = (f"it is not in the local datasets cache and the Hub cannot be reached ({offline})" if offline
               else f"{type(err).__name__}: {err}".splitlines()[0])
        fewshot = (f" (and DIR/{task}/{spec.fewshot_split}.jsonl for evaluate.num_fewshot > 0)"
                   if spec.fewshot_split else "")
        raise TaskError(f"{task}: cannot load {path} ({split}) from the Hugging Face Hub: {why}. To score from local "
                        f"files, set evaluate.data_dir=DIR holding DIR/{task}/{split}.jsonl{fewshot}, one JSON record "
                        f"per line in the task's published form (docs/evaluation.md)") from None


def _cache_only() -> None:
    """Hugging Face's offline mode, for `datasets` imported now or before: it reads its local cache and never
    the network."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    for module in ("huggingface_hub.constants", "datasets.config"):
        if module in sys.modules:
            sys.modules[module].HF_HUB_OFFLINE = True
