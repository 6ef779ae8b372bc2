"""Machine faults for tests, injected into a Python process (a `python -m train` and its data workers) by
its environment, without root or a real small disk.

Python imports `sitecustomize` when it starts, from the first folder of its path that holds one: a test
puts this folder first in PYTHONPATH and the faults, as JSON, in GPT3D_TEST_FAULTS
(tests/helpers/machine_faults.py). Without that variable this module does nothing. gpt3d's own code holds
no hook: what it meets are the OS errors real calls raise, from the functions it calls (open, os.mkdir,
os.replace, shutil.disk_usage, …), which are replaced here, in this process only, before gpt3d is imported.

The faults (any of them; paths absolute):
  "disk":       {"root": R, "capacity": C}  the file system under R holds C bytes: a write that would take
                what is under R past C writes what fits and fails with ENOSPC, and shutil.disk_usage of a
                path under R says C total and what is left free
  "read_only":  {"root": R, "when": W}      once the path W exists, every write, folder made, rename or
                removal under R fails with EROFS (the folder was remounted read-only)
  "unreadable": {"match": M, "when": W, "lines": K, "times": N}  once W exists and holds K lines (a
                metrics.jsonl with K records), opening a file whose path contains M for reading fails with
                ENOENT, N times (null: every time; the file stays gone)
  "log":        L                            each fault injected is one line appended to L: "<errno name> <path>"
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import shutil
import threading

_ORIGINAL = {"open": builtins.open, "mkdir": os.mkdir, "rename": os.rename, "replace": os.replace,
             "unlink": os.unlink, "rmdir": os.rmdir, "disk_usage": shutil.disk_usage}
_WRITE_MODES = set("wax+")


class _Faults:
    """The faults of GPT3D_TEST_FAULTS and what is left of them (see the module docstring)."""

    def __init__(self, spec: dict):
        self.disk, self.read_only, self.unreadable = spec.get("disk"), spec.get("read_only"), spec.get("unreadable")
        self.log_path = spec.get("log")
        self.reads_failed = 0
        self.lock = threading.Lock()

    def fail(self, number: int, path: str) -> OSError:
        """The OS error `number` for `path`, written to the log first."""
        if self.log_path:
            with _ORIGINAL["open"](self.log_path, "a") as log:
                log.write(f"{errno.errorcode[number]} {path}\n")
        return OSError(number, os.strerror(number), path)

    def writable(self, path: str) -> None:
        """EROFS once the run folder has turned read-only."""
        ro = self.read_only
        if ro and _under(path, ro["root"]) and _happened(ro):
            raise self.fail(errno.EROFS, path)

    def readable(self, path: str) -> None:
        """ENOENT for a data file that is gone, as many times as asked."""
        gone = self.unreadable
        if not gone or gone["match"] not in path or not _happened(gone):
            return
        with self.lock:
            if gone["times"] is not None and self.reads_failed >= gone["times"]:
                return
            self.reads_failed += 1
        raise self.fail(errno.ENOENT, path)

    def used(self) -> int:
        """Bytes of the files under the disk's root."""
        total = 0
        for folder, _, names in os.walk(self.disk["root"]):
            for name in names:
                try:
                    total += os.lstat(os.path.join(folder, name)).st_size
                except OSError:
                    continue
        return total


class _Metered:
    """A file under the small disk: each write checks the room left, writes what fits, flushes (so the
    disk's use is the files' sizes) and fails with ENOSPC when it did not all fit."""

    def __init__(self, faults: _Faults, file, path: str):
        self._faults, self._file, self._path = faults, file, path

    def write(self, data):
        size = len(data.encode()) if isinstance(data, str) else memoryview(data).nbytes
        with self._faults.lock:
            room = self._faults.disk["capacity"] - self._faults.used()
            if size > room:
                if room > 0 and not isinstance(data, str):
                    self._file.write(memoryview(data).cast("B")[:room])
                    self._file.flush()
                raise self._faults.fail(errno.ENOSPC, self._path)
            written = self._file.write(data)
            self._file.flush()
        return written

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()

    def __getattr__(self, name):
        return getattr(self._file, name)


def _happened(fault: dict) -> bool:
    """Whether a fault's moment has come: its path "when" exists, holding at least "lines" lines (default 0)."""
    if not os.path.exists(fault["when"]):
        return False
    if not fault.get("lines"):
        return True
    with _ORIGINAL["open"](fault["when"], "rb") as file:
        return file.read().count(b"\n") >= fault["lines"]


def _under(path: str, root: str) -> bool:
    path = os.path.abspath(path)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _path(file) -> str | None:
    return os.path.abspath(os.fsdecode(file)) if isinstance(file, (str, bytes, os.PathLike)) else None


def _install(faults: _Faults) -> None:
    """Replace the functions the faults go through (module docstring)."""

    def opened(file, mode="r", *args, **kwargs):
        path = _path(file)
        if path is None:
            return _ORIGINAL["open"](file, mode, *args, **kwargs)
        if _WRITE_MODES & set(mode):
            faults.writable(path)
            handle = _ORIGINAL["open"](file, mode, *args, **kwargs)
            disk = faults.disk
            return _Metered(faults, handle, path) if disk and _under(path, disk["root"]) else handle
        faults.readable(path)
        return _ORIGINAL["open"](file, mode, *args, **kwargs)

    def changing(name: str):
        def change(path, *args, **kwargs):
            if name == "mkdir" and os.path.exists(path):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(path))
            if _path(path) is not None:
                faults.writable(_path(path))
            return _ORIGINAL[name](path, *args, **kwargs)
        return change

    def disk_usage(path):
        disk = faults.disk
        if disk and _under(os.path.abspath(path), disk["root"]):
            used = faults.used()
            return shutil._ntuple_diskusage(disk["capacity"], used, max(disk["capacity"] - used, 0))
        return _ORIGINAL["disk_usage"](path)

    builtins.open = io.open = opened
    for name in ("mkdir", "rename", "replace", "unlink", "rmdir"):
        setattr(os, name, changing(name))
    os.remove = os.unlink
    shutil.disk_usage = disk_usage


if os.environ.get("GPT3D_TEST_FAULTS"):
    _install(_Faults(json.loads(os.environ["GPT3D_TEST_FAULTS"])))
