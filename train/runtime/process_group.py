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


def skip_shared_memory_op() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce op, which gpt3d never calls.

    When its communication layer starts, DeepSpeed JIT-compiles `deepspeed_shm_comm` (C++, into
    the shared torch extension cache) for `inference_all_reduce`, an inference-only collective;
    training goes through torch.distributed. The build takes 40–70 s on 2 cores, and two
    environments sharing the cache (other compiler flags or include paths) rebuild it in turn at
    every launch. DeepSpeed builds only ops marked compatible in `deepspeed.ops.__compatible_ops__`,
    a table it keeps as one editable dict; marking this op incompatible skips the build.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _quiet_deepspeed() -> None:
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
