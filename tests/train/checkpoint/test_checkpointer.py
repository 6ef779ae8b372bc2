"""When the Checkpointer saves: every `interval` steps and at the last step, each step at most once.

The writer's save is replaced by a counter (what a save writes is the other checkpoint tests'
business), and the guard by one that records what the Checkpointer asks of it before each save.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from train.checkpoint import CheckpointParts, Checkpointer, CheckpointSettings


class Guard:
    def __init__(self):
        self.calls = []

    def phase(self, what: str) -> None:
        self.calls.append(what)

    def before_saving(self, step: int, device) -> None:
        self.calls.append(f"finite at {step}")

    def watch_writes(self, failed) -> None:
        self.calls.append("watching writes")


def saved_steps(tmp_path, interval: int, calls: list[tuple[int, bool]], guard: Guard | None = None) -> list[int]:
    """The steps of `calls` ((step, last) each, as the loop makes them) that wrote a checkpoint."""
    settings = CheckpointSettings(tmp_path, interval, keep=3, keep_every=0, asynchronous=False)
    checkpointer = Checkpointer(settings, CheckpointParts(), None, SimpleNamespace(rank=1), None, torch.device("cpu"))
    writes = []
    checkpointer.writer.save = lambda *args: writes.append(args)
    checkpointer.connect(guard or Guard(), logger=None)  # nothing is published: the logger is never called
    saved = []
    for step, last in calls:
        before = len(writes)
        checkpointer.save(step, last=last)
        saved += [step] * (len(writes) - before)
    return saved


def test_saves_every_interval_and_at_the_last_step(tmp_path):
    guard = Guard()
    assert saved_steps(tmp_path, 3, [(step, step == 7) for step in range(1, 8)], guard) == [3, 6, 7]
    assert guard.calls[:3] == ["watching writes", "checkpoint at step 3", "finite at 3"]


def test_a_stop_after_a_saved_step_saves_it_once(tmp_path):
    """A stop signal after step 3, which the interval saved, then (another run) after step 4."""
    assert saved_steps(tmp_path, 3, [(1, False), (2, False), (3, False), (3, True)]) == [3]
    assert saved_steps(tmp_path, 3, [(4, False), (4, True)]) == [4]


def test_interval_zero_saves_only_the_last_step(tmp_path):
    assert saved_steps(tmp_path, 0, [(step, step == 4) for step in range(1, 5)]) == [4]
