"""What the launcher tells each process, for naming one shared run directory.

Every rank of a run must write into the same Hydra run directory, but Hydra's `${now:}` is
resolved by each process separately. `launch_timestamp` gives all ranks started by one launcher
the same value: GPT3D_RUN_STAMP if the launch script set it (multi-node), else the start time of
the launcher process that spawned this rank (torchrun's agent, deepspeed's launch.py), which the
ranks of a node share; a process started by hand uses its own start.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def launched_by_launcher() -> bool:
    return "LOCAL_RANK" in os.environ


def launcher_stops_all_at_first_exit() -> bool:
    """Whether this rank's launcher ends every rank as soon as one exits: torchrun's agent (it sets
    TORCHELASTIC_RUN_ID) and DeepSpeed's launch.py (CROSS_RANK) do; srun as launch/slurm.sbatch runs it
    (--kill-on-bad-exit=0) does not."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "CROSS_RANK" in os.environ


def launch_timestamp(fmt: str = "%Y-%m-%d_%H-%M-%S") -> str:
    stamp = os.environ.get("GPT3D_RUN_STAMP")
    if stamp:
        return stamp
    started = _process_start(os.getppid()) if launched_by_launcher() else None
    return time.strftime(fmt, time.localtime(started if started is not None else time.time()))


def _process_start(pid: int) -> float | None:
    """A process's start time (seconds since the epoch) from /proc, or None where /proc is absent."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks_after_boot = int(fields[19])  # field 22 of stat; fields[0] is field 3
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
        return boot + ticks_after_boot / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
