"""What the training loop does about faults, in one object: stop requests (train/guard/preemption.py),
hangs (train/guard/watchdog.py) and non-finite steps (train/guard/nonfinite.py).

Per step the loop calls `step_begins` (arms the watchdog), `after_step` (takes the step's outcome), `settle`
when it logs, evaluates or saves, `check_skips` once the step is logged (stops after
train.max_consecutive_skips in a row) and, last, `agree` (the step's one agreement: did any rank get a stop
signal, see its checkpoint write in the background fail (`watch_writes`), or find a data file of the next
step unreadable?). `before_saving` refuses a checkpoint of non-finite weights.

A step's outcome (its loss finite or not, its update skipped or applied, on every rank) is known on the
device: our optimizers decide the skip there (train/run/optimizer.py), so that a step that does not log
reads nothing back. `after_step` queues the outcome's checks as a LateRead (train/runtime/late_read.py)
and settles the step before: its skip counted (the engine's `skipped_steps`, the LR schedule's tokens
taken back, the line saying so) and the checks proved, one step late, waiting for that step's work only.
`settle` settles every queued step at once, where the loop reads the device anyway (a record, an
evaluation, a checkpoint, the run's end): a step that logs or saves is settled exactly, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from train.config.sections import TrainConfig
from train.guard import nonfinite, preemption
from train.guard.watchdog import FIRST_STEP_FACTOR, Watchdog
from train.runtime.late_read import LateRead


@dataclass
class Outcome:
    """A step's outcome, not yet read: its StepResult, its batch's tokens and its checks on the device."""

    step: int
    result: object
    tokens: int
    checks: LateRead


class Safeguards:
    """The guards of one run, set by its train section (train.step_timeout_s, train.max_consecutive_skips)."""

    def __init__(self, train: TrainConfig, run_dir: Path, engine, rank: int, say, resumed_from: Path | None = None):
        import torch.distributed as dist

        self.run_dir, self.engine, self.rank, self.say = Path(run_dir), engine, rank, say
        self.last_checkpoint = resumed_from  # the newest checkpoint this run loaded or wrote (for messages)
        self.timeout = float(train.step_timeout_s)
        self.skips = nonfinite.SkipCounter(int(train.max_consecutive_skips), total=engine.skipped_steps)
        self.signals = preemption.StopSignals(rank)
        self.watchdog = Watchdog(run_dir, rank)
        self._first = True
        self._write_failed = lambda: False  # set by `watch_writes`
        self._queued: list[Outcome] = []  # outcomes not yet settled, oldest first
        # the agreement's host tensors need a gloo group where the world's is nccl (every rank makes it here)
        gloo = dist.get_world_size() == 1 or dist.get_backend() == "gloo"
        self.host_group = None if gloo else dist.new_group(backend="gloo")
        self.signals.install()
        if rank == 0:
            preemption.clear_marker(run_dir)  # this run is under way again

    def step_begins(self, step: int) -> None:
        self.signals.step = step
        self.watchdog.arm(self.timeout * (FIRST_STEP_FACTOR if self._first else 1), f"step {step}")
        self._first = False

    def phase(self, what: str) -> None:
        """A fresh deadline for a long part of a step: an evaluation, a checkpoint."""
        self.watchdog.arm(self.timeout, what)

    def after_step(self, step: int, result, tokens: int) -> None:
        """Queue `step`'s outcome (`result`: its StepResult; `tokens`: its batch's) and settle the steps before it."""
        checks = LateRead(preemption.device_checks(result.loss, result.skipped))
        self._queued.append(Outcome(step, result, tokens, checks))
        while len(self._queued) > 1:
            self._settle(self._queued.pop(0))

    def settle(self) -> None:
        """Settle every queued step (the loop calls this where it reads the device anyway)."""
        while self._queued:
            self._settle(self._queued.pop(0))

    def _settle(self, outcome: "Outcome") -> None:
        """Prove the step's checks; count a skip (those decided on the device: the engine's count and the LR
        schedule's tokens, which DeepSpeed took as applied), and say so."""
        skipped = preemption.check_outcome(outcome.checks.tolist())
        if skipped and isinstance(outcome.result.skipped, torch.Tensor):
            self.engine.skipped_steps += 1
            self.engine.lr_scheduler.take_back(outcome.tokens)
        self.skips.update(outcome.step, skipped, self.engine.skipped_steps)
        if skipped:
            self.say(nonfinite.skip_line(outcome.step, float(outcome.result.loss), outcome.result.grad_norm, self.skips))

    def check_skips(self, device) -> None:
        """NonFiniteError after train.max_consecutive_skips skipped steps in a row (every rank alike), as settled."""
        if self.skips.exhausted:
            bad = nonfinite.count_over_ranks(len(nonfinite.non_finite_parameters(self.engine.module)), device)
            raise nonfinite.too_many_skips(self.skips.last, self.skips, weights_ok=bad == 0,
                                           last_checkpoint=self.last_checkpoint)

    def before_saving(self, step: int, device) -> None:
        """Raise NonFiniteError instead of writing a checkpoint whose weights are not finite (on any rank)."""
        bad = nonfinite.non_finite_parameters(self.engine.module)
        ranks_with_bad = nonfinite.count_over_ranks(int(bool(bad)), device)
        if ranks_with_bad:
            raise nonfinite.refuse_to_save(step, bad, ranks_with_bad, self.last_checkpoint)

    def watch_writes(self, failed) -> None:
        """`failed()`: whether this rank's checkpoint write in the background has failed (the Checkpointer's
        writer); `agree` asks it at the end of every step."""
        self._write_failed = failed

    def agree(self, step: int, data_failed: bool = False) -> preemption.Verdict:
        """The end of `step`, agreed by every rank (train/guard/preemption.py); `data_failed`: this rank could
        not read a data file the next step needs."""
        return preemption.agree(step, self.signals, self._write_failed(), data_failed, self.host_group)

    def stopped(self, step: int, verdict: preemption.Verdict, saved: Path, finished: bool) -> None:
        """After the checkpoint of a signalled stop: the marker a job script requeues on (unless the run
        had reached its last step anyway), and the message."""
        if self.rank == 0 and not finished:
            preemption.write_marker(self.run_dir, step, verdict, saved)
        self.say(preemption.stop_message(step, verdict, saved, self.run_dir, finished))

    def saved(self, path: Path) -> None:
        self.last_checkpoint = path

    def close(self) -> None:
        self.watchdog.close()
        self.signals.restore()
