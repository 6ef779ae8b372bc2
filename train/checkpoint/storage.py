"""The disk under a run's checkpoints: what a save needs, what is free, and what a save that the disk
refuses says.

A checkpoint's tensors take 12 bytes a parameter (train/planner/counts.py: `checkpoint_bytes`, the planner's
count). Retention keeps `train.keep_checkpoints` of them, and a save writes the next one before the oldest
goes, so at its peak a run's checkpoints take keep_checkpoints + 1 of them. `preflight`, before the first
step, compares that with the free space of the file system the checkpoints go to and warns in one line
when it does not fit.

A save fails as `SaveFailed` (every rank alike; train/checkpoint/saving.py), naming the first rank's error.
When that error is the file system's refusal (`is_storage_error`: no space left, over quota, read-only,
not permitted), `cannot_save` makes it a `StorageError` whose message is the line the run stops with: the
folder, the bytes the save needs and the bytes free, the checkpoint that is kept, and the way out. The
command exits with EXIT_CANNOT_SAVE (train/config/entry.py).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Callable

from train.checkpoint import files
from train.checkpoint.files import CheckpointError

NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
STORAGE_ERRNOS = NO_SPACE | {errno.EROFS, errno.EACCES, errno.EPERM}


class SaveFailed(CheckpointError):
    """A checkpoint write that failed on some rank (raised on every rank alike): `step`, and `cause`, the
    first failing rank's error (an OSError when the file system refused)."""

    def __init__(self, step: int, cause: BaseException):
        super().__init__(f"the checkpoint of step {step} could not be written: {_text(cause)}")
        self.step, self.cause = step, cause


class StorageError(CheckpointError):
    """A save the file system refused (full, over quota, read-only, not permitted); the message is the
    run's last line."""


def is_storage_error(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in STORAGE_ERRNOS


def first_cause(causes: list[BaseException]) -> BaseException:
    """Of several ranks' errors, a storage error if there is one (it says what to do), else the first.
    An error that wraps an OSError (its __cause__ or __context__) counts as that OSError."""
    unwrapped = [_os_error_in(err) or err for err in causes]
    return next((err for err in unwrapped if is_storage_error(err)), unwrapped[0])


def _os_error_in(err: BaseException | None) -> OSError | None:
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def free_bytes(folder: Path) -> int:
    """Free bytes of the file system that holds `folder` (or its nearest existing parent), as this user
    may use them."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def size_text(n: int) -> str:
    """A byte count for people, in decimal units as `df -H` gives them: 950 B, 20.6 MB, 2.1 TB."""
    if n < 1000:
        return f"{n} B"
    value, units = n / 1000, ["kB", "MB", "GB", "TB"]
    while value >= 1000 and len(units) > 1:
        value, units = value / 1000, units[1:]
    return f"{value:.1f} {units[0]}"


def preflight(root: Path, each: int, keep: int, warn: Callable[[str], None]) -> None:
    """Warn (one line) when the file system under `root` (a run's checkpoints/ folder, made or not) has less
    free space than retention needs: `keep` + 1 checkpoints of `each` bytes while a save is written, less
    those already there (at most `keep`: a resumed run's)."""
    present = min(len(files.step_folders(root)), keep)
    needed, free = (keep + 1 - present) * each, free_bytes(root)
    if needed > free:
        there = f", {present} already there" if present else ""
        warn(f"{root} has {size_text(free)} free, less than the {size_text(needed)} its checkpoints need "
             f"(train.keep_checkpoints={keep} of {size_text(each)} each and the one a save writes before the oldest "
             f"goes{there}); free space there, lower train.keep_checkpoints, or {_move('larger')}")


def cannot_save(failed: SaveFailed, root: Path, each: int, keep: int, kept: Path | None) -> CheckpointError:
    """The error a failed save stops the run with: a StorageError, one line, when the file system refused it
    (`failed.cause`), else `failed` itself. `root`: the checkpoints/ folder; `each`: a checkpoint's bytes;
    `kept`: the newest checkpoint on disk, which a resume takes (None: none yet)."""
    cause = failed.cause
    if not is_storage_error(cause):
        return failed
    full = cause.errno in NO_SPACE
    verb = "does not fit in" if full else "cannot be written in"
    way = (f"free space there, lower train.keep_checkpoints (now {keep}), or {_move('larger')}" if full else
           f"make {root} writable again, or {_move('writable')}")
    kept_text = f"the newest checkpoint, {kept}, is kept" if kept is not None else "no checkpoint was written before"
    return StorageError(f"the checkpoint of step {failed.step} {verb} {root} ({cause.strerror or cause}): it needs "
                        f"{size_text(each)}, {size_text(free_bytes(root))} free; {kept_text}; {way}")


def _move(disk: str) -> str:
    return f"move the run folder to a {disk} disk and resume there (hydra.run.dir=<new folder>)"


def _text(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    return str(err) or repr(err)
