"""What a run tells the people watching it, in one place: its story on stdout (`say`) and warnings on
stderr (`warn`: one line, `gpt3d: warning: …`, for something the run survives: a damaged checkpoint
passed over, a bad data record skipped, a write that failed after another error).

`speaks` says whether this process prints: a line about the whole run is printed by one process
(rank 0), not once per process.

Where stdout is a terminal, `status` shows a live line (a progress bar) that each later line of the run
replaces; in a log file or a pipe it prints nothing, so logs hold only the run's lines.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Callable


def say(text: str, speaks: bool = True) -> None:
    """Print one line of the run's story on stdout, when this process speaks."""
    if speaks:
        clear_status()
        print(text, flush=True)


def warn(text: str, speaks: bool = True) -> None:
    """Print one warning on stderr, when this process speaks."""
    if speaks:
        clear_status()
        print(f"gpt3d: warning: {text}", file=sys.stderr, flush=True)


def status(text: str, speaks: bool = True) -> None:
    """Show `text` as the terminal's live line, rewritten in place, when this process speaks and stdout is a
    terminal; otherwise nothing."""
    if speaks and sys.stdout.isatty():
        sys.stdout.write(f"\r{text}\033[K")
        sys.stdout.flush()


def clear_status() -> None:
    """Take a status line off the terminal (before a line printed elsewhere: an error). Where none is shown the
    cursor is at the start of an empty line, which the same erase leaves as it is: nothing to remember."""
    if sys.stdout.isatty():
        sys.stdout.write("\r\033[K")
        sys.stdout.flush()


def warner(speaks: bool) -> Callable[[str], None]:
    """`warn` for code that takes a `warn(text)` function: printing when this process speaks, else
    dropping the line."""
    return partial(warn, speaks=speaks)
