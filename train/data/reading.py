"""Reading data that may fail for a while: a network file system's hiccup, a file moved and put back, a
Hub that throttles, errs, drops a connection or stalls.

Every open of a data file (and the size check before it) goes through a `Reader`, and so does every HTTP
request of a streamed Hub dataset (train/data/hub_client.py). A read that fails with an OSError is tried
again `retries` times (data.read_retries), after `wait_s` (data.read_retry_s), then twice as long after
each failure, or after as long as the server asked (an error's `retry_after`, seconds: HTTP's Retry-After,
up to RETRY_AFTER_MAX_S); each retry is one warning line and counted (`made`; the run logs the count as
data/read_retries). Data still unreadable after the last retry is DataUnavailable, naming the file or URL:
the run saves a checkpoint of the step it is at and stops (train/run/loop.py), and resumes exactly once the
data is back. A retry changes nothing that is read, so a run whose reads succeed on a retry trains on the
same batches as one whose reads never failed.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, TypeVar
from urllib.parse import urlsplit

from train.data.sources import DataError, DataSpec
from train.monitor import report

T = TypeVar("T")
RETRY_AFTER_MAX_S = 600.0  # the longest wait a server's Retry-After is followed for


class DataUnavailable(DataError):
    """A data file, or a Hub request, that stayed unreadable after its retries: `path` (the file or the URL;
    None: another rank's, which that rank names), why, the retries made, and `after`, what the run did."""

    def __init__(self, path: str | None, reason: str, retries: int, after: str = ""):
        super().__init__(path, reason, retries, after)
        self.path, self.reason, self.retries, self.after = path, reason, retries, after

    def __str__(self) -> str:
        what = (f"data: {self.path} could not be read ({self.reason}), also after {self.retries} retries"
                if self.path is not None else f"data: another rank could not read a data file ({self.reason})")
        return f"{what}; {self.after}" if self.after else what

    @property
    def remedy(self) -> str:
        """What brings the data back: the file put back, or the server that serves it answering again."""
        where = urlsplit(self.path or "")
        if where.scheme in ("http", "https"):
            return f"once {where.scheme}://{where.netloc} answers again, re-run the same command"
        return "put the file back and re-run the same command"

    def stopped(self, after: str) -> DataUnavailable:
        """The same error, saying what the run did about it."""
        return DataUnavailable(self.path, self.reason, self.retries, after)


class Reader:
    """Reads data, retrying what fails (see the module docstring); `made`: the retries so far, over every
    thread that reads through it. `timeout_s`: how long a network read may wait for its next byte before it
    fails (data.read_timeout_s; None: no limit)."""

    def __init__(self, retries: int = 0, wait_s: float = 1.0, warn: bool = True, timeout_s: float | None = None):
        self.retries, self.wait_s, self.warn, self.timeout_s = retries, wait_s, warn, timeout_s
        self.made = 0
        self._lock = threading.Lock()

    @classmethod
    def of(cls, spec: DataSpec, warn: bool = True) -> Reader:
        """The reader the data settings of `spec` ask for."""
        return cls(spec.read_retries, spec.read_retry_s, warn, spec.read_timeout_s)

    def call(self, path: str, read: Callable[[str], T]) -> T:
        """`read(path)`, tried again after an OSError (see the module docstring); DataUnavailable once the
        retries are spent."""
        attempt = 0
        while True:
            try:
                return read(path)
            except OSError as err:
                attempt = self.failed(path, err, attempt)

    def failed(self, path: str, err: OSError, attempt: int) -> int:
        """A read of `path` failed with `err` after `attempt` retries of it: warn, count and wait, and return
        the retry this is (attempt + 1); DataUnavailable when the retries are spent."""
        reason = err.strerror or str(err) or type(err).__name__
        if attempt == self.retries:
            raise DataUnavailable(path, reason, self.retries) from None
        wait = max(self.wait_s * 2**attempt, min(getattr(err, "retry_after", None) or 0.0, RETRY_AFTER_MAX_S))
        with self._lock:
            self.made += 1
        if self.warn:
            report.warn(f"data: {path} could not be read ({reason}); retry {attempt + 1} of {self.retries} in {wait:g} s")
        time.sleep(wait)
        return attempt + 1

    def read_bytes(self, path: str) -> bytes:
        """The whole file."""
        return self.call(path, _read_all)

    def size(self, path: str) -> int:
        """The file's size in bytes."""
        return self.call(path, os.path.getsize)


def _read_all(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()
