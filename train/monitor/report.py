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


_status_shown = False  # a status line is on the terminal, to be cleared before the next line


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
    global _status_shown
    if speaks and sys.stdout.isatty():
        sys.stdout.write(f"\r{text}\033[K")
        sys.stdout.flush()
        _status_shown = True


def clear_status() -> None:
    """Take the status line off the terminal, if one is there (before a line printed elsewhere: an error)."""
    global _status_shown
    if _status_shown:
        sys.stdout.write("\r\033[K")
        sys.stdout.flush()
        _status_shown = False


def warner(speaks: bool) -> Callable[[str], None]:
    """`warn` for code that takes a `warn(text)` function: printing when this process speaks, else
    dropping the line."""
    return partial(warn, speaks=speaks)
