"""The process group every run, one process included, trains in.

`init_distributed` joins the launcher's group (torchrun, deepspeed, srun) or makes a one-process one,
with DeepSpeed's communication layer on top and a timeout on every collective;
`shutdown_distributed` ends it on every rank together.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch

from parallel.topology import skip_shared_memory_op


def init_distributed(device: torch.device, timeout_s: float = 1800.0) -> None:
    """Join the launcher's process group (torchrun / deepspeed / srun), or make a one-process one.

    DeepSpeed picks gloo on CPU and nccl on CUDA; DS_ACCELERATOR is pinned so a CPU run on a
    GPU machine stays on the CPU. A collective that waits longer than `timeout_s`
    (train.collective_timeout_s) fails instead of waiting forever. A process that has joined one
    already (a benchmark building several engines) keeps it.
    """
    import torch.distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    if "RANK" not in os.environ:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    import deepspeed

    _quiet_deepspeed()
    skip_shared_memory_op()
    _default_group_timeout(timedelta(seconds=timeout_s))
    if device.type == "cuda" and not dist.is_initialized():
        local = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(local)
        # Bound to its GPU from the start (NCCL otherwise guesses the device from the global rank);
        # DeepSpeed then adopts this group.
        dist.init_process_group("nccl", device_id=local, timeout=timedelta(seconds=timeout_s))
    deepspeed.init_distributed(verbose=False, timeout=timedelta(seconds=timeout_s))


def shutdown_distributed() -> None:
    """End a finished run's process group on every rank together: a barrier, then the group's
    teardown, so no rank exits while a peer's communication threads still talk to it (left to the
    interpreter's exit, gloo pipelines now and then aborted one rank after a run had finished)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _default_group_timeout(timeout: timedelta) -> None:
    """The timeout of the groups made later (tp, pp, dp: DeepSpeed's and ours), which torch's
    new_group takes from these module defaults, not from the world group: set once, at start."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _quiet_deepspeed() -> None:
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
