"""Opening a data file that may fail for a while: a network file system's hiccup, a file moved and put back.

Every open of a data file (and the size check before it) goes through a `Reader`. An OSError is tried
again `retries` times (data.read_retries), after `wait_s` (data.read_retry_s), then twice as long after
each failure; each retry is one warning line and counted (`made`; the run logs the count as
data/read_retries). A file still unreadable after the last retry is DataUnavailable, naming it: the run
saves a checkpoint of the step it is at and stops (train/run/loop.py), and resumes exactly once the file is
back. A retry changes nothing that is read, so a run whose reads succeed on a retry trains on the same
batches as one whose reads never failed.
"""

from __future__ import annotations

import os
import time
from typing import Callable, TypeVar

from train.data.sources import DataError
from train.monitor import report

T = TypeVar("T")


class DataUnavailable(DataError):
    """A data file that stayed unreadable after its retries: `path` (None: another rank's file, which that
    rank names), why, the retries made, and `after`, what the run did about it."""

    def __init__(self, path: str | None, reason: str, retries: int, after: str = ""):
        super().__init__(path, reason, retries, after)
        self.path, self.reason, self.retries, self.after = path, reason, retries, after

    def __str__(self) -> str:
        what = (f"data: {self.path} could not be read ({self.reason}), also after {self.retries} retries"
                if self.path is not None else f"data: another rank could not read a data file ({self.reason})")
        return f"{what}; {self.after}" if self.after else what

    def stopped(self, after: str) -> DataUnavailable:
        """The same error, saying what the run did about it."""
        return DataUnavailable(self.path, self.reason, self.retries, after)


class Reader:
    """Reads data files, retrying what fails (see the module docstring); `made`: the retries so far."""

    def __init__(self, retries: int = 0, wait_s: float = 1.0, warn: bool = True):
        self.retries, self.wait_s, self.warn = retries, wait_s, warn
        self.made = 0

    def call(self, path: str, read: Callable[[str], T]) -> T:
        """`read(path)`, tried again after an OSError (see the module docstring); DataUnavailable once the
        retries are spent."""
        attempt = 0
        while True:
            try:
                return read(path)
            except OSError as err:
                reason = err.strerror or str(err) or type(err).__name__
                if attempt == self.retries:
                    raise DataUnavailable(path, reason, self.retries) from None
                wait = self.wait_s * 2**attempt
                attempt += 1
                self.made += 1
                if self.warn:
                    report.warn(f"data: {path} could not be read ({reason}); retry {attempt} of {self.retries} "
                                f"in {wait:g} s")
                time.sleep(wait)

    def read_bytes(self, path: str) -> bytes:
        """The whole file."""
        return self.call(path, _read_all)

    def size(self, path: str) -> int:
        """The file's size in bytes."""
        return self.call(path, os.path.getsize)


def _read_all(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()
