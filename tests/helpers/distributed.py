"""Run a function on N CPU processes joined in one gloo process group, from a test.

    results = run_distributed(check_something, 2, arg1, arg2)

starts 2 fresh (spawned) interpreters; in each, rank r of a gloo group of 2 with the usual
launcher environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) set, it calls
check_something(arg1, arg2) and returns each rank's return value, in rank order. The function
must be a module-level (picklable) function; its arguments and return value must pickle
(tensors, dicts, lists). If any rank raises, the others are stopped and RankFailed is raised
with that rank's traceback; if the ranks do not finish within `timeout` seconds, they are
killed and RankFailed says so. Each rank runs torch with one thread (`threads` to change it).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank of a distributed test raised, crashed or timed out."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank, fn, world_size, port, args, result_dir, threads, timeout):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
    try:
        result = fn(*args)
        torch.save(result, Path(result_dir) / f"rank{rank}.pt")
        dist.barrier()  # every rank done before any tears down (as train.runtime.process_group.shutdown_distributed)
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0, threads: int = 1) -> list:
    """fn(*args) on world_size gloo ranks; returns [rank 0's result, rank 1's, …]."""
    name = getattr(fn, "__qualname__", repr(fn))
    with tempfile.TemporaryDirectory(prefix="gpt3d-dist-") as result_dir:
        context = mp.start_processes(
            _rank_main,
            args=(fn, world_size, free_port(), args, result_dir, threads, timeout),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
                if time.monotonic() >= deadline:
                    _kill(context)
                    raise RankFailed(f"{name} on {world_size} ranks did not finish within {timeout:.0f} s")
        except mp.ProcessRaisedException as error:
            raise RankFailed(f"{name}: rank {error.error_index} of {world_size} raised:\n{error}") from None
        except mp.ProcessExitedException as error:
            raise RankFailed(
                f"{name}: rank {error.error_index} of {world_size} died with exit code {error.exit_code}"
            ) from None
        return [torch.load(Path(result_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _kill(context) -> None:
    for process in context.processes:
        if process.is_alive():
            process.kill()
        process.join()
