"""What a run tells the people watching it, in one place: its story on stdout (`say`) and warnings on
stderr (`warn`: one line, `gpt3d: warning: …`, for something the run survives: a damaged checkpoint
passed over, a bad data record skipped, a write that failed after another error).

`speaks` says whether this process prints: a line about the whole run is printed by one process
(rank 0), not once per process.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Callable


def say(text: str, speaks: bool = True) -> None:
    """Print one line of the run's story on stdout, when this process speaks."""
    if speaks:
        print(text, flush=True)


def warn(text: str, speaks: bool = True) -> None:
    """Print one warning on stderr, when this process speaks."""
    if speaks:
        print(f"gpt3d: warning: {text}", file=sys.stderr, flush=True)


def warner(speaks: bool) -> Callable[[str], None]:
    """`warn` for code that takes a `warn(text)` function: printing when this process speaks, else
    dropping the line."""
    return partial(warn, speaks=speaks)
