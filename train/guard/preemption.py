"""Stopping on request: SIGTERM, SIGINT and SIGUSR1 finish the current step, save a checkpoint, exit 0.

A signal may reach only some ranks (a scheduler signalling one node, a `kill` by hand), and a rank
that stopped alone would leave the others blocked in their next collective. So a signal only sets a
flag. At the end of every step (after its logging, evaluation and checkpoint) the ranks all-reduce
(max) one small vector of integers in host memory, `agree`, holding each rank's flag together with the
machine's faults a rank saw (a failed checkpoint write in the background, a data file the next step
cannot read), and all stop when any rank was signalled. The step's own checks (its loss not finite, its
update skipped or applied) live on the device and are read later (`device_checks`, `check_outcome`). The step that was
running when the signal arrived is finished and the checkpoint is at that step. (Python runs a signal handler only
once the C++ call under way returns: a signal that comes during the closing collective itself is
seen after it, and counts for the next step.)

SIGINT twice exits at once, without a checkpoint: the second one must come at least
`DUPLICATE_WINDOW_S` after the first, since a launcher that passes the terminal's Ctrl-C on to its
workers (torchrun does) delivers a second copy within milliseconds.

`<run dir>/preempted.json` marks a run that stopped on a signal before its last step (step, signal,
checkpoint): a job script requeues the job when it is there (launch/slurm.sbatch). The run removes it
when it starts again and when it finishes.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from train.monitor.metrics import write_atomically

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
DUPLICATE_WINDOW_S = 1.0
MARKER = "preempted.json"


class StopSignals:
    """Turns SIGTERM / SIGINT / SIGUSR1 into a stop request (`received`: the first signal's number)."""

    def __init__(self, rank: int):
        self.rank, self.received = rank, 0
        self.step = 0  # the step running now (set by the loop); `received_step`: the one a signal came in
        self.received_step = 0
        self._first_interrupt: float | None = None
        self._previous: dict = {}

    def install(self) -> None:
        """Handle the stop signals from now on, and take the ones held pending while the run started
        (`python -m train` blocks SIGUSR1 first thing, train/__main__.py: a scheduler's warning that came
        while the run started is taken here, and the run stops after its first step)."""
        if threading.current_thread() is threading.main_thread():  # Python lets only the main thread set handlers
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame) -> None:
        now = time.monotonic()
        if signum == signal.SIGINT:
            if self._first_interrupt is not None:
                if now - self._first_interrupt >= DUPLICATE_WINDOW_S:
                    _write(f"gpt3d: rank {self.rank}: second interrupt: exiting now, without a checkpoint\n")
                    os._exit(128 + signal.SIGINT)
                return
            self._first_interrupt = now
        if self.received:
            return
        self.received, self.received_step = signum, self.step
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one line per node, not one per rank
            what = f"during step {self.step}: finishing it" if self.step else "while the run started: training one step"
            _write(f"gpt3d: rank {self.rank}: {signal.Signals(signum).name} {what}, "
                   f"then saving a checkpoint and stopping (Ctrl-C again to exit at once, without one)\n")


    def take(self, step: int) -> tuple[int, int]:
        """(signal, the step it came in; 0, 0 for none) for the agreement that ends `step`; a signal handled
        from now on belongs to step + 1. No handler can run between the read and the advance: CPython runs
        Python signal handlers only at calls and backward jumps, and there are none in between. (A signal
        that arrives while the agreement's collective is under way is handled when it returns: the next step's.)"""
        taken, self.step = (self.received, self.received_step), step + 1
        return taken


def _write(text: str) -> None:
    """To stderr from a signal handler: one unbuffered write (print could re-enter a buffered stream)."""
    os.write(2, text.encode())


@dataclass(frozen=True)
class Verdict:
    """What the ranks agreed at the end of a step."""

    signal: int  # the largest signal number any rank received since it started (0: none)
    rank: int | None  # the largest rank that received one
    step: int  # the step that rank was running when it came
    write_failed: bool = False  # a checkpoint write in the background failed, on some rank
    data_failed: bool = False  # a data file the next step needs stayed unreadable, on some rank


def agree(step: int, signals: StopSignals, write_failed: bool = False, data_failed: bool = False,
          group=None) -> Verdict:
    """The one agreement of a step, in host memory: max over ranks of
    [signal, rank + 1, step the signal came in, write failed, data failed], all-reduced over `group` (a
    gloo group of host tensors: nothing waits for the device) when there are other ranks. The first three
    say whether any rank was asked to stop; the last two are the machine's faults this rank saw (a failed
    background write, a data file that stayed unreadable): when any rank saw one, every rank stops after
    the step (train/run/loop.py). What only the device knows, the step's loss and skip, is checked
    apart (`device_checks`, `check_outcome`)."""
    import torch.distributed as dist

    received, received_step = signals.take(step)
    flags = [received, dist.get_rank() + 1 if received else 0, received_step, int(write_failed), int(data_failed)]
    if dist.get_world_size(group) > 1:
        agreed = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        flags = agreed.tolist()
    signum, who, signal_step, write, data = flags
    return Verdict(signum, who - 1 if who else None, signal_step, bool(write), bool(data))


def device_checks(loss: torch.Tensor, skipped: torch.Tensor | bool) -> torch.Tensor:
    """(ranks, 2): [loss, applied] of this step on every rank (applied = 1 − skipped), on the device (a stack,
    and an all-gather when there are other ranks: queued, never waited for). `check_outcome` reads and judges
    it later."""
    import torch.distributed as dist

    skip = skipped if isinstance(skipped, torch.Tensor) else torch.full((), float(skipped), device=loss.device)
    mine = torch.stack([loss.float(), 1 - skip])  # (2,)
    if dist.get_world_size() == 1:
        return mine.unsqueeze(0)  # (1, 2)
    every = mine.new_empty(dist.get_world_size() * 2)  # flat: gloo gathers into a flat tensor only
    dist.all_gather_into_tensor(every, mine)
    return every.view(-1, 2)  # (ranks, 2)


def check_outcome(checks: list[list[float]]) -> bool:
    """Whether the step was skipped, from its `device_checks` as read (a [loss, applied] pair a rank); raises
    when the step was skipped on some ranks and applied on others, or applied on a rank whose loss was not
    finite (train/guard/nonfinite.py explains why neither can happen; this proves it, for every step)."""
    skips = [not applied for _, applied in checks]
    if any(skips) and not all(skips):
        raise RuntimeError("the ranks disagree on whether this step's update was skipped; their weights now differ")
    if not skips[0] and not all(math.isfinite(loss) for loss, _ in checks):
        raise RuntimeError("a rank's loss was not finite, yet the optimizer applied the update")
    return skips[0]


def write_marker(run_dir: Path, step: int, verdict: Verdict, checkpoint: Path) -> None:
    """<run dir>/preempted.json (rank 0; temporary name, then renamed)."""
    record = {"step": step, "signal": signal.Signals(verdict.signal).name, "rank": verdict.rank,
              "signal_step": verdict.step, "checkpoint": str(checkpoint)}
    write_atomically(Path(run_dir) / MARKER, json.dumps(record) + "\n")


def clear_marker(run_dir: Path) -> None:
    (Path(run_dir) / MARKER).unlink(missing_ok=True)


def stop_message(step: int, verdict: Verdict, checkpoint: Path, run_dir: Path, finished: bool) -> str:
    name = signal.Signals(verdict.signal).name
    what = ("the run had reached its last step" if finished else
            f"to resume, re-run the same command with hydra.run.dir={run_dir} (train.resume=auto)")
    when = f"during step {verdict.step}" if verdict.step else "while the run started"
    return (f"{name} reached rank {verdict.rank} {when}: stopped after step {step}, checkpoint "
            f"{checkpoint}; {what}")
