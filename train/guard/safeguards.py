"""What the training loop does about faults, in one object: stop requests (train/guard/preemption.py),
hangs (train/guard/watchdog.py) and non-finite steps (train/guard/nonfinite.py).

Per step the loop calls `step_begins` (arms the watchdog), `after_step` (counts a skipped step),
`check_skips` once the step is logged (stops after train.max_consecutive_skips in a row) and, last,
`agree` (the step's one collective: did any rank get a stop signal, see its checkpoint write in the
background fail (`watch_writes`), or find a data file of the next step unreadable?). `before_saving`
refuses a checkpoint of non-finite weights.
"""

from __future__ import annotations

from pathlib import Path

from train.config.sections import TrainConfig
from train.guard import nonfinite, preemption
from train.guard.watchdog import FIRST_STEP_FACTOR, Watchdog


class Safeguards:
    """The guards of one run, set by its train section (train.step_timeout_s, train.max_consecutive_skips)."""

    def __init__(self, train: TrainConfig, run_dir: Path, engine, rank: int, say, resumed_from: Path | None = None):
        self.run_dir, self.engine, self.rank, self.say = Path(run_dir), engine, rank, say
        self.last_checkpoint = resumed_from  # the newest checkpoint this run loaded or wrote (for messages)
        self.timeout = float(train.step_timeout_s)
        self.skips = nonfinite.SkipCounter(int(train.max_consecutive_skips), total=engine.skipped_steps)
        self.signals = preemption.StopSignals(rank)
        self.watchdog = Watchdog(run_dir, rank)
        self._first = True
        self._write_failed = lambda: False  # set by `watch_writes`
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

    def after_step(self, step: int, result) -> None:
        """Count a skipped step (every rank skipped it: the optimizers decide from one global norm) and say so."""
        self.skips.update(step, result.skipped, self.engine.skipped_steps)
        if result.skipped:
            self.say(nonfinite.skip_line(step, float(result.loss), result.grad_norm, self.skips))

    def check_skips(self, step: int, device) -> None:
        """NonFiniteError after train.max_consecutive_skips skipped steps in a row (every rank alike)."""
        if self.skips.exhausted:
            bad = nonfinite.count_over_ranks(len(nonfinite.non_finite_parameters(self.engine.module)), device)
            raise nonfinite.too_many_skips(step, self.skips, weights_ok=bad == 0, last_checkpoint=self.last_checkpoint)

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

    def agree(self, step: int, result, data_failed: bool = False) -> preemption.Verdict:
        """The end of `step`, agreed by every rank (train/guard/preemption.py); `data_failed`: this rank could
        not read a data file the next step needs."""
        return preemption.agree(step, result.loss, result.skipped, self.signals, self._write_failed(), data_failed)

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
