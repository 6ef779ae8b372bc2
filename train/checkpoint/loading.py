"""Loading a checkpoint: a resume at this run's layout, whatever layout saved it, and the whole
model's weights in one process (generation, export).

A resume asks DCP for exactly the regions this rank's layout needs, in batches of about
LOAD_BATCH_BYTES, and writes them back through DeepSpeed's safe_set_full_* (or into the torch AdamW
at ZeRO-0). So (tp, pp, dp, ZeRO stage, offload) may all differ between the run that saved and the
one that resumes.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from model import GPTConfig
from train.checkpoint import files, integrity
from train.checkpoint.files import CheckpointError
from train.checkpoint.optimizer_state import KINDS, ParameterState
from train.checkpoint.parts import CheckpointParts
from train.monitor import report

if TYPE_CHECKING:
    from train.checkpoint import tensors
    from train.checkpoint.resume_point import ResumePoint

LOAD_BATCH_BYTES = 1 << 30  # fp32 state read per DCP load call on one rank


def load(engine, topology, model_cfg: GPTConfig, point: ResumePoint, parts: CheckpointParts) -> tuple[Path, dict]:
    """Resume from `point` (the checkpoint the resume checks chose and verified in every process, but for
    the shards' checksums) at this run's layout, whatever layout saved it (every rank calls it): model,
    fp32 master weights, Adam moments and step count, then every registered part (this rank's per-rank
    ones last). The folder is loaded once all ranks together find it intact (`_intact`). Returns (the
    folder used, its state.json)."""
    from train.checkpoint import tensors  # deferred: see train/checkpoint/tensors.py

    import torch.distributed as dist

    folder, state = _intact(point, report.warner(dist.get_rank() == 0))
    integrity.check_model(state["model"], model_cfg, folder)
    reader = tensors.ShardReader(folder)
    params = ParameterState(engine)
    params.ensure_state()
    _restore(engine.module, model_cfg, topology, params, reader)
    params.set_step_count(state["optimizer"]["adam_step"])
    parts.load(state)
    ranks = files.read_json(folder / files.RNG)["ranks"]
    parts.load(ranks[dist.get_rank() % len(ranks)], per_rank=True)  # the same rank's at the same layout
    return folder, state


def _intact(point: ResumePoint, warn) -> tuple[Path, dict]:
    """(folder, state.json) to load: the point's own when its files are intact, every checksum (the
    shards' too) checked by all ranks together (its content was checked before the build). Otherwise it
    is reported (`warn`) and the previous intact one is taken, verified whole the same way, when it
    records the same schedule as the point (which the run was resolved from); another schedule, or a
    point that names its one step folder (train.resume=<step folder>), is a CheckpointError."""
    _, problems = integrity.file_problems(point.folder, shared=True)
    if not problems:
        return point.folder, point.state
    warn(integrity.passed_over(point.folder, problems))
    if not integrity.holds_checkpoints(point.path):  # train.resume named that one step folder
        raise integrity.damaged(point.folder, problems)
    folder, state = integrity.select(point.path, warn=warn, before=point.folder, shared=True)
    if state.get("extra") != point.state.get("extra"):
        raise CheckpointError(
            f"checkpoint {point.folder} passed the checks before the build but its tensor files are damaged, and "
            f"the previous intact one, {folder}, records another schedule; move {point.folder} away and start again")
    return folder, state


def _restore(part, model_cfg: GPTConfig, topology, params: ParameterState, reader: tensors.ShardReader) -> None:
    """Every local parameter (each Parameter once) from its region of the saved full tensors, in
    batches; every rank makes the same number of DCP calls (a collective), some with nothing to read."""
    from train.checkpoint import tensors  # deferred: see train/checkpoint/tensors.py

    import torch.distributed as dist

    from parallel.naming import parameter_map

    seen, todo = set(), []
    for local, shard in parameter_map(part, model_cfg, topology).items():
        param = part.get_parameter(local)
        if id(param) not in seen:
            seen.add(id(param))
            todo.append((param, shard))
    batches, size = [[]], 0
    for param, shard in todo:
        nbytes = 4 * len(KINDS) * torch.Size(shard.local_shape).numel()
        if batches[-1] and size + nbytes > LOAD_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append((param, shard))
        size += nbytes
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, len(batches))  # an object collective: also on NCCL, with no device tensor
    for i in range(max(counts)):
        batch = batches[i] if i < len(batches) else []
        requests = {}
        for _, shard in batch:
            if not tensors.is_empty(shard.index):
                offsets, sizes = tensors.region(shard.index)
                for kind in KINDS:
                    requests[f"{kind}/{shard.name}"] = tensors.FullSlice(torch.empty(sizes), shard.full_shape, offsets)
        tensors.read(requests, reader)
        for param, shard in batch:
            values = {}
            for kind in KINDS:
                local = torch.zeros(shard.local_shape)  # vocabulary padding rows stay zero
                if not tensors.is_empty(shard.index):
                    local[shard.local_index] = requests[f"{kind}/{shard.name}"].tensor
                values[kind] = local
            params.set_(param, values)


def saved_model_config(folder: Path) -> dict:
    """The model config a (verified) checkpoint folder was saved with."""
    return integrity.checked_state(folder)["model"]


def read_model_weights(folder: Path, config: GPTConfig) -> dict[str, torch.Tensor]:
    """{full parameter name: fp32 tensor} of the whole model from a checkpoint folder that `select`
    verified (so its tensors tile this model exactly), written at any layout, in this process (no
    process group needed)."""
    from train.checkpoint import tensors  # deferred: see train/checkpoint/tensors.py

    from parallel.naming import full_shapes

    reader = tensors.ShardReader(folder)
    requests = {f"model/{name}": torch.empty(shape) for name, shape in full_shapes(config).items()}
    with warnings.catch_warnings():  # DCP's note that it reads in one process: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        tensors.read(requests, reader, distributed=False)
    return {name.removeprefix("model/"): tensor for name, tensor in requests.items()}
