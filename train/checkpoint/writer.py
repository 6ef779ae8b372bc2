"""A run's checkpoint saves, written in this thread or in the background (train.async_checkpoint).

A save has two halves (train/checkpoint/saving.py): `stage` gathers every rank's share of the state
(collectives on the training process group, in the training thread), and `write` puts it on disk and
publishes it. Synchronously, training waits for both. Asynchronously it waits only for the staging:
the tensors are copied into host memory that training never touches (a clone on the CPU; on CUDA a
pinned buffer, kept from one save to the next), and the write runs in a thread of its own. That
thread's collectives (DCP's planning, the shared hashing, rank 0's verdict) go over a process group
of its own (gloo), made once by every rank at the start: collectives of two threads on one process
group could pair one rank's training all-reduce with another rank's checkpoint gather. The files are
the ones a synchronous save writes, by the same function; `latest` moves, as there, only once rank 0
has every rank's files hashed and the folder published, and every rank's writer thread ends only
after that (or with the same error).

At most one save is in flight: a save first waits for the write before it, and so does the end of a
run (`wait`). A write that failed is raised as CheckpointError there, on every rank alike: the ranks'
writer threads end with the same outcome at about the same moment, but each rank sees that at a step
boundary of its own, so a rank only reports it (`failed`) and the ranks agree at the end of the step
that the run stops (train/guard/preemption.py), then every rank raises it. A failed write leaves no
temporary folder (train/checkpoint/saving.py). A run killed during a write keeps the previous
checkpoint as `latest`; the temporary folder left behind is removed when the run starts again
(train/checkpoint/checkpointer.py).

Times: `pause_s`, how long training stood still for a save (waiting for the previous write, the
staging, and, synchronously, the write), and `write_s`, how long its write took.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from train.checkpoint import saving
from train.checkpoint.files import CheckpointError

if TYPE_CHECKING:
    from model import GPTConfig


@dataclass(frozen=True)
class Written:
    """A checkpoint that is on disk and published."""

    path: Path
    step: int
    write_s: float


class CheckpointWriter:
    """The saves of one run; every rank makes one, at the same point (async: a process-group creation)."""

    def __init__(self, asynchronous: bool, keep: int, keep_every: int):
        import torch.distributed as dist

        self.asynchronous, self.keep, self.keep_every = asynchronous, keep, keep_every
        self.group = dist.new_group(backend="gloo") if asynchronous else None
        self._pinned: dict[str, torch.Tensor] = {}  # CUDA: host buffers reused by every save
        self._thread: threading.Thread | None = None
        self._outcome: Written | BaseException | None = None  # of the write in flight, once it ends
        self._written: list[Written] = []  # published, not yet taken by `written`
        self._pause_s: list[float] = []
        self._write_s: list[float] = []

    def save(self, engine, topology, model_cfg: GPTConfig, run_dir: Path, parts, stopped_at: float) -> None:
        """Checkpoint the run as it stands (every rank): wait for the write in flight (its failure is
        raised here), stage, then write here or in the background. `stopped_at`: the
        time.perf_counter() at which training stopped for this save, for its pause."""
        self.wait()
        if not self.asynchronous:
            staged = saving.stage(engine, topology, model_cfg, run_dir, parts)
            started = time.perf_counter()
            path = saving.write(staged, keep=self.keep, keep_every=self.keep_every)
            self._published(Written(path, staged.step, time.perf_counter() - started))
        else:
            staged = saving.stage(engine, topology, model_cfg, run_dir, parts, host_copy=self._host_copy)
            if self._pinned:
                torch.cuda.current_stream().synchronize()  # the copies into pinned memory have landed
            self._thread = threading.Thread(target=self._write, args=(staged,), name=f"checkpoint-{staged.step}",
                                            daemon=True)
            self._thread.start()
        self._pause_s.append(time.perf_counter() - stopped_at)

    def _host_copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of `tensor` that training does not write: a clone of a CPU tensor; a device
        tensor copied (without waiting) into a pinned buffer, the same one at every save."""
        if tensor.device.type == "cpu":
            return tensor.clone(memory_format=torch.contiguous_format)
        buffer = self._pinned.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._pinned[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return buffer.copy_(tensor, non_blocking=True)

    def _write(self, staged: saving.Staged) -> None:
        """The writer thread: `saving.write` over the writer's own process group."""
        started = time.perf_counter()
        try:
            path = saving.write(staged, keep=self.keep, keep_every=self.keep_every, group=self.group)
            self._outcome = Written(path, staged.step, time.perf_counter() - started)
        except BaseException as err:  # kept for `wait`, raised in the training thread
            self._outcome = err

    def _collect(self) -> None:
        """Take the outcome of the write that ended: its record, or its error raised."""
        outcome, self._outcome, self._thread = self._outcome, None, None
        if isinstance(outcome, BaseException):
            if isinstance(outcome, CheckpointError):
                raise outcome
            raise CheckpointError(f"a checkpoint write failed: {outcome!r}") from outcome
        if outcome is not None:
            self._published(outcome)

    def _published(self, written: Written) -> None:
        self._written.append(written)
        self._write_s.append(written.write_s)

    def wait(self) -> None:
        """Until the write in flight (if any) has ended; CheckpointError if it failed."""
        if self._thread is not None:
            self._thread.join()
        self._collect()

    def failed(self) -> bool:
        """Whether the write in flight has ended with an error that `wait` has not raised yet (this rank's
        view: the ranks agree on it at the end of the step, train/guard/preemption.py)."""
        thread = self._thread
        return thread is not None and not thread.is_alive() and isinstance(self._outcome, BaseException)

    def written(self) -> list[Written]:
        """The checkpoints published since the last call, taking a write that has ended (never raising:
        a failed write is kept for `wait`)."""
        if self._thread is not None and not self._thread.is_alive() and not isinstance(self._outcome, BaseException):
            self._collect()
        done, self._written = self._written, []
        return done

    def times(self) -> dict:
        """The metrics of the saves since the last call: perf/checkpoint_pause_s, the seconds training
        stood still for them, and perf/checkpoint_write_s, the seconds of the writes that ended
        (summed; None when there were none)."""
        pause, write = self._pause_s, self._write_s
        self._pause_s, self._write_s = [], []
        return {"perf/checkpoint_pause_s": sum(pause) if pause else None,
                "perf/checkpoint_write_s": sum(write) if write else None}
