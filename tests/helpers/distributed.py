"""Run a function on N CPU processes joined in one gloo process group, from a test.

    results = run_distributed(check_something, 2, arg1, arg2)

forks 2 processes from the worker's warm interpreter (tests/helpers/warm.py: torch and gpt3d imported
once); in each, rank r of a gloo group of 2 with the usual launcher environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) set, it calls check_something(arg1, arg2) and returns each rank's
return value, in rank order. The function must be a module-level function; its arguments and return
value must pickle (tensors, dicts, lists). If any rank raises, RankFailed is raised with that rank's
traceback; if the ranks do not finish within `timeout` seconds, they are killed and RankFailed says
so. Each rank runs torch with one thread (`threads` to change it).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from cli import clean_env, free_port


class RankFailed(RuntimeError):
    """A rank of a distributed test raised, crashed or timed out."""


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0, threads: int = 1) -> list:
    """fn(*args) on world_size gloo ranks; returns [rank 0's result, rank 1's, …]. The ranks are forked from
    this worker's warm interpreter (tests/helpers/warm.py), which imports fn's module once."""
    import pickle
    import sys

    from warm import Warm

    name = getattr(fn, "__qualname__", repr(fn))
    module = sys.modules[fn.__module__]
    with tempfile.TemporaryDirectory(prefix="gpt3d-dist-") as result_dir:
        args_file = Path(result_dir) / "args.pkl"
        args_file.write_bytes(pickle.dumps(args))
        env = clean_env()  # the environment of the commands the tests start: the same warm interpreter forks both
        warm = Warm.shared()
        ranks = warm.call(module.__file__, fn.__module__, fn.__qualname__, args_file, world_size, free_port(),
                          Path(result_dir), threads, timeout, env, err=str(Path(result_dir) / "rank{rank}.err"))
        codes = warm.wait(ranks, timeout)
        if codes is None:
            raise RankFailed(f"{name} on {world_size} ranks did not finish within {timeout:.0f} s")
        for rank, code in enumerate(codes):
            if code != 0:
                log = Path(result_dir) / f"rank{rank}.err"
                said = log.read_text()[-5000:] if log.exists() else ""
                raise RankFailed(f"{name}: rank {rank} of {world_size} raised (exit code {code}):\n{said}")
        return [torch.load(Path(result_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
