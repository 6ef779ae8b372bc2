"""A run's checkpoints, as the training loop sees them: one object, `Checkpointer`.

The loop calls `restore()` once (the resume point the run specification names, loaded at this
run's layout), `connect(guard, logger)` once they exist, and `save(step, last=…)` after every step:
the Checkpointer decides whether a save is due (every `interval` steps, and at the run's last step,
which a stop signal makes of any step), has the guard refuse non-finite weights, saves through the
writer (train/checkpoint/writer.py: here or in the background, one write in flight, retention after
each) and announces every checkpoint published since the last call: a line, the guard's last
checkpoint (for its messages) and the W&B artifact (the logger). At the run's last step it waits for
the write, so a run ends with its checkpoint on disk; after an error, `close()` lets the write in
flight finish. `times()` gives the checkpoint metrics of the loop's next record.

The disk (train/checkpoint/storage.py): before the first step `restore()` warns when the run folder's
file system cannot hold what retention keeps. A save the file system refuses (full, read-only) stops the
run with one line (StorageError), the earlier checkpoints intact; a write in the background that fails
is reported to the guard, whose agreement at the end of the step stops every rank with that line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from train.checkpoint import files, loading, saving, storage
from train.checkpoint.files import CheckpointError
from train.checkpoint.parts import CheckpointParts
from train.checkpoint.storage import SaveFailed
from train.checkpoint.writer import CheckpointWriter
from train.config.sections import TrainConfig
from train.monitor import report

if TYPE_CHECKING:
    from model import GPTConfig
    from train.checkpoint.resume_point import ResumePoint


@dataclass(frozen=True)
class CheckpointSettings:
    """What a run asks of its checkpoints, resolved (`from_config` reads the train.* keys)."""

    run_dir: Path  # checkpoints go into <run_dir>/checkpoints/
    interval: int  # a save every `interval` steps (0: none but the last step's)
    keep: int  # step folders kept beyond those that `keep_every` keeps
    keep_every: int  # steps that are multiples of it are kept too (0: none)
    asynchronous: bool  # written in a thread of its own (train.async_checkpoint)
    resume: ResumePoint | None = None  # where the run starts from (train/checkpoint/resume_point.py)

    @classmethod
    def from_config(cls, train: TrainConfig, run_dir: Path, device: torch.device, resume: ResumePoint | None
                    ) -> CheckpointSettings:
        """From the train.* section of the config: checkpoint_interval, keep_checkpoints, keep_every and
        async_checkpoint (true, false, or auto: true on CUDA, where the write would stall the accelerator;
        false on the CPU, where the writer thread would take cores from training)."""
        setting = train.async_checkpoint
        asynchronous = device.type == "cuda" if setting == "auto" else bool(setting)
        return cls(Path(run_dir), int(train.checkpoint_interval), int(train.keep_checkpoints), int(train.keep_every),
                   asynchronous, resume)


class Checkpointer:
    """Saves and restores one run: the engine's tensors (fp32 masters, Adam moments) and the registered
    `parts`. Every rank makes one, at the same point (a background writer makes a process group)."""

    def __init__(self, settings: CheckpointSettings, parts: CheckpointParts, engine, topology, model_cfg: GPTConfig,
                 device: torch.device):
        self.settings, self.parts = settings, parts
        self.engine, self.topology, self.model_cfg, self.device = engine, topology, model_cfg, device
        self.writer = CheckpointWriter(settings.asynchronous, settings.keep, settings.keep_every)
        self._speaks = topology.rank == 0
        self._saved_step: int | None = None  # the step of the last save made
        self._guard = self._logger = None

    def restore(self) -> Path | None:
        """Load the resume point (settings.resume; None: a fresh start) into the engine and every part,
        say so, remove what interrupted saves left behind, and warn when the disk cannot hold the
        checkpoints retention keeps (storage.preflight). Returns the step folder loaded, or None."""
        point, folder = self.settings.resume, None
        if point is not None:
            folder, state = loading.load(self.engine, self.topology, self.model_cfg, point, self.parts)
            saved, now = state["layout"], saving.layout_of(self.engine, self.topology)
            moved = "" if saved == now else f" (saved at {_layout_text(saved)}, now {_layout_text(now)})"
            report.say(f"resumed from {folder} at step {state['step']}{moved}", self._speaks)
        if self._speaks:
            root = files.checkpoint_dir(self.settings.run_dir)
            for name in files.remove_leftovers(root):
                report.say(f"removed checkpoints/{name}: a save that was interrupted")
            storage.preflight(root, self._bytes(), self.settings.keep, report.warn)
        return folder

    def _bytes(self) -> int:
        """A checkpoint's bytes, as the planner counts them."""
        from train.planner.counts import checkpoint_bytes

        return checkpoint_bytes(self.model_cfg)

    def connect(self, guard, logger) -> None:
        """From here on, saves go through `guard` (train/guard/safeguards.py: a fresh watchdog deadline,
        no checkpoint of non-finite weights; it keeps the last checkpoint for its messages) and are
        announced to `logger` (train/monitor/metrics.py: a W&B artifact when asked); the guard's agreement at the
        end of every step asks whether a write in the background has failed."""
        self._guard, self._logger = guard, logger
        guard.watch_writes(self.writer.failed)

    def save(self, step: int, *, last: bool = False) -> None:
        """Checkpoint the run at `step` (every rank calls it, after every step) when a save is due: every
        settings.interval steps, and at the run's last step (`last`: its final step, or the one a stop
        signal ends it after), unless `step` was saved already; then announce every checkpoint published
        since the last call. At the last step the write is waited for, and announced. A write that failed
        is raised here (a StorageError when the file system refused it, else CheckpointError), at the next
        save or the last step: once the ranks agreed that a write in the background failed, the loop makes
        that step the last."""
        try:
            if self.due(step, last=last):
                stopped_at = time.perf_counter()
                self._guard.phase(f"checkpoint at step {step}")
                self._guard.before_saving(step, self.device)  # NonFiniteError instead of non-finite weights
                self.writer.save(self.engine, self.topology, self.model_cfg, self.settings.run_dir, self.parts,
                                 stopped_at)
                self._saved_step = step
            if last:
                self.writer.wait()
        except SaveFailed as err:
            raise self._refused(err) from None
        for written in self.writer.written():
            self._guard.saved(written.path)
            report.say(f"checkpoint {written.path}", self._speaks)
            self._logger.checkpoint(written.path, written.step)

    def due(self, step: int, *, last: bool = False) -> bool:
        """Whether `save(step, last=last)` writes a checkpoint: every settings.interval steps and at the last
        step, unless `step` was saved already."""
        interval = self.settings.interval
        return step != self._saved_step and (last or (interval > 0 and step % interval == 0))

    def times(self) -> dict:
        """The checkpoint metrics since the last call (train/checkpoint/writer.py: `times`)."""
        return self.writer.times()

    def close(self) -> None:
        """The run stops with an error: the write in flight finishes (that checkpoint was staged before
        the fault), and its own failure is only a warning (the first error is the one raised)."""
        try:
            self.writer.wait()
        except SaveFailed as err:
            report.warn(str(self._refused(err)))
        except CheckpointError as err:
            report.warn(str(err))

    def _refused(self, failed: SaveFailed) -> CheckpointError:
        """What a failed save stops the run with (storage.cannot_save), naming the newest step folder: the one
        `train.resume=auto` takes (also when the save failed after publishing its folder, before `latest`)."""
        root = files.checkpoint_dir(self.settings.run_dir)
        newest = files.step_folders(root)[:1]
        return storage.cannot_save(failed, root, self._bytes(), self.settings.keep, newest[0] if newest else None)


def _layout_text(layout: dict) -> str:
    offload = " offload" if layout["offload_optimizer"] else ""
    return f"tp={layout['tp']} pp={layout['pp']} dp={layout['dp']} zero={layout['zero_stage']}{offload}"
