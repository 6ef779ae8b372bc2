"""Hangs: a step that runs far longer than it should writes every thread's Python stack and exits.

A rank blocked in a collective whose peer died or stopped would wait for the process group's own
timeout (train.collective_timeout_s) and then fail with little to go on. The watchdog is a daemon
thread with a deadline that the loop sets at each step (train.step_timeout_s; the first step after a
start, which compiles kernels and autotunes, gets FIRST_STEP_FACTOR times as long) and again before an
evaluation or a checkpoint. When a deadline passes, the rank writes the stacks of all its threads
(faulthandler) to <run dir>/stacks/rank<r>.txt, says so on stderr and exits with code EXIT_CODE at once
(os._exit: the main thread may be stuck inside a collective), so that a scheduler can restart the job.
Every live rank of a hung run does the same, each on its own deadline.

The thread sleeps on a condition variable until a deadline is due or changed: a step costs one
assignment under a lock.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from pathlib import Path

EXIT_CODE = 3
FIRST_STEP_FACTOR = 3


class Watchdog:
    """`arm(seconds, what)` starts a deadline for `what` (e.g. "step 7"), replacing the one before."""

    def __init__(self, run_dir: Path, rank: int):
        self.path = Path(run_dir) / "stacks" / f"rank{rank}.txt"
        self.rank = rank
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._what, self._seconds, self._closed = "", 0.0, False
        self._thread = threading.Thread(target=self._watch, name="gpt3d-watchdog", daemon=True)
        self._thread.start()

    def arm(self, seconds: float, what: str) -> None:
        with self._cond:
            self._deadline, self._seconds, self._what = time.monotonic() + seconds, seconds, what
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                left = None if self._deadline is None else self._deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._fire()
                self._cond.wait(left)

    def _fire(self) -> None:
        """Write the stacks and leave; never returns."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as file:
            file.write(f"gpt3d: rank {self.rank}: {self._what} ran past its {self._seconds:.0f} s limit "
                       f"(train.step_timeout_s); the Python stacks of this rank's threads:\n\n")
            file.flush()
            faulthandler.dump_traceback(file, all_threads=True)
        os.write(2, (f"gpt3d: error: rank {self.rank}: {self._what} ran past its {self._seconds:.0f} s limit "
                     f"(train.step_timeout_s): a hang, or a rank that died or stopped; stacks in {self.path}; "
                     f"exiting with code {EXIT_CODE}\n").encode())
        os._exit(EXIT_CODE)
