"""The process grid: pipeline × data × tensor parallel, tensor innermost.

World rank r sits at coordinates (pp, dp, tp) with r = (pp·dp_size + dp)·tp_size + tp, so the tp
ranks of one group are neighbours (one node, fastest links), the dp replicas of a stage come next
and pipeline stages are furthest apart. The grid and its process groups are DeepSpeed's own
(PipeModelDataParallelTopology + PipelineParallelGrid), so the object handed to
`deepspeed.initialize(mpu=...)` and to a PipelineModule(topology=...) agrees with ours.

`check_layout` validates a layout against a model without any process group, so a bad
combination fails in a line before anything heavy starts.
"""

from __future__ import annotations

import contextlib
import io
import math

import torch.distributed as dist


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _fmt(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def _check_positive(**values: int | None) -> None:
    for key, value in values.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"parallel.{key}={value!r}: must be a positive integer")


def _world_problem(tp: int, pp: int, world_size: int, dp: int | None = None) -> str | None:
    """Why tp·pp·dp cannot tile world_size, or None."""
    processes = f"{world_size} process" + ("es" if world_size != 1 else "")
    if world_size % (tp * pp):
        return (
            f"world size {world_size} is not a multiple of tp·pp = {tp * pp} (parallel.tp={tp}, parallel.pp={pp}); "
            f"with {processes} tp·pp must be one of: {_fmt(divisors(world_size))}"
        )
    if dp is not None and tp * pp * dp != world_size:
        return (
            f"world size {world_size} ≠ tp·pp·dp = {tp * pp * dp} (parallel.tp={tp}, parallel.pp={pp}, "
            f"parallel.dp={dp}); with {processes}, tp={tp} and pp={pp} dp must be {world_size // (tp * pp)}"
        )
    return None


def check_layout(n_head: int, d_ff: int, tp: int, pp: int, n_layer: int, world_size: int, dp: int | None = None) -> int:
    """Validate a (tp, pp[, dp]) layout for a model on `world_size` processes; returns dp.

    Tensor parallelism splits heads and MLP columns, so tp must divide n_head and d_ff; each
    pipeline stage needs at least one block, so pp ≤ n_layer; and world_size = tp·pp·dp.
    Raises one ValueError naming every violated rule, the values and what would fit.
    """
    _check_positive(tp=tp, pp=pp, dp=dp)
    problem = _world_problem(tp, pp, world_size, dp)
    problems = [problem] if problem else []
    fitting_tp = divisors(math.gcd(n_head, d_ff))
    if n_head % tp:
        problems.append(f"parallel.tp={tp} does not divide model.n_head={n_head}; valid tp: {_fmt(fitting_tp)}")
    if d_ff % tp:
        problems.append(f"parallel.tp={tp} does not divide model.d_ff={d_ff}; valid tp: {_fmt(fitting_tp)}")
    if pp > n_layer:
        problems.append(
            f"parallel.pp={pp} exceeds model.n_layer={n_layer}: every pipeline stage needs at least "
            f"one transformer block; valid pp: 1 … {n_layer}"
        )
    if problems:
        raise ValueError("impossible parallel layout: " + "; ".join(problems))
    return world_size // (tp * pp)


class Topology:
    """Ranks, sizes and process groups of one pp × dp × tp layout.

    `mpu` is DeepSpeed's PipelineParallelGrid (pass it as deepspeed.initialize(mpu=...)); `grid_topology`
    is its ProcessTopology (pass it as PipelineModule(topology=...)). In a single process without
    torch.distributed both are None, as are the groups, and every rank is 0.
    """

    def __init__(self, tp: int, pp: int, dp: int, grid=None):
        self.tp_size, self.pp_size, self.dp_size = tp, pp, dp
        self.mpu = grid

    @classmethod
    def create(cls, tp: int = 1, pp: int = 1, world_size: int | None = None) -> "Topology":
        """The layout with tp·pp·dp = world size (dp is what remains).

        world_size defaults to torch.distributed's; when torch.distributed is initialised all ranks
        must call this together (it creates every group). Without torch.distributed only the
        one-process layout (tp = pp = 1) exists.
        """
        initialised = dist.is_available() and dist.is_initialized()
        actual = dist.get_world_size() if initialised else 1
        if world_size is not None and world_size != actual:
            raise ValueError(f"world_size={world_size} given, but this job has {actual} process(es)")
        _check_positive(tp=tp, pp=pp)
        problem = _world_problem(tp, pp, actual)
        if problem:
            raise ValueError(f"impossible parallel layout: {problem}")
        dp = actual // (tp * pp)
        if not initialised:
            return cls(tp, pp, dp)
        from deepspeed import comm as ds_comm
        from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

        skip_shared_memory_op()
        ds_comm.init_distributed(dist_backend=dist.get_backend(), verbose=False)  # wraps the existing group
        with contextlib.redirect_stdout(io.StringIO()):  # the grid prints its whole rank map on rank 0
            grid = PipelineParallelGrid(topology=PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp))
        return cls(tp, pp, dp, grid)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def grid_topology(self):
        """DeepSpeed's ProcessTopology with axes (pipe, data, model); None without torch.distributed."""
        return self.mpu.topology() if self.mpu is not None else None

    @property
    def rank(self) -> int:
        return self.mpu.get_global_rank() if self.mpu is not None else 0

    @property
    def tp_rank(self) -> int:
        return self.mpu.get_tensor_model_parallel_rank() if self.mpu is not None else 0

    @property
    def dp_rank(self) -> int:
        return self.mpu.get_data_parallel_rank() if self.mpu is not None else 0

    @property
    def pp_rank(self) -> int:
        return self.mpu.get_pipe_parallel_rank() if self.mpu is not None else 0

    @property
    def tp_group(self):
        """The ranks sharing this rank's tensor-parallel shards (same pp and dp coordinates)."""
        return self.mpu.get_slice_parallel_group() if self.mpu is not None else None

    @property
    def dp_group(self):
        """The replicas of this rank's shard (same pp and tp coordinates): gradients are averaged here."""
        return self.mpu.get_data_parallel_group() if self.mpu is not None else None

    @property
    def pp_group(self):
        """The stages of this rank's pipeline (same dp and tp coordinates)."""
        return self.mpu.get_pipe_parallel_group() if self.mpu is not None else None

    @property
    def model_parallel_group(self):
        """All ranks holding one copy of the model (pp × tp): DeepSpeed sums grad norms over it."""
        return self.mpu.get_model_parallel_group() if self.mpu is not None else None

    def __repr__(self) -> str:
        return (
            f"Topology(tp={self.tp_size}, pp={self.pp_size}, dp={self.dp_size}; rank {self.rank} = "
            f"(pp {self.pp_rank}, dp {self.dp_rank}, tp {self.tp_rank}))"
        )


def skip_shared_memory_op() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce op, which gpt3d never calls.

    When its communication layer starts, DeepSpeed JIT-compiles `deepspeed_shm_comm` (C++, into
    the shared torch extension cache) for `inference_all_reduce`, an inference-only collective;
    training goes through torch.distributed. The build takes 40–70 s on 2 cores, and two
    environments sharing the cache (other compiler flags or include paths) rebuild it in turn at
    every launch; a build killed midway leaves a lock file that every later build waits on without
    end. Topology.create skips it where DeepSpeed's layer starts there (on a process group torch
    made, as the tests' ranks do), as train/runtime/process_group.py's init_distributed does.
    DeepSpeed builds only ops marked compatible in `deepspeed.ops.__compatible_ops__`, a table it
    keeps as one editable dict; marking this op incompatible skips the build.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
