"""Saving a checkpoint: `stage` gathers every rank's share of the run's state, `write` puts it on disk
and publishes it; `save` is one then the other, in this thread (train/checkpoint/writer.py runs the
write in the background).

What a checkpoint holds (train/checkpoint/files.py shows the folder):

  tensors     for every full-model parameter (parallel/naming.py's names): its fp32 master
              weights ("model/<name>") and AdamW moments ("exp_avg/<name>", "exp_avg_sq/<name>"),
              each rank saving its tensor-parallel slice as a chunk of the full tensor, through
              torch.distributed.checkpoint into safetensors files (train/checkpoint/tensors.py)
  state.json  AdamW's step count, the model config, the layout, the gpt3d version, and the entries
              of the run's registered parts (train/checkpoint/parts.py): step and tokens, the data
              position, the LR schedule, DeepSpeed's step counters, the schedule record ("extra")
  rng.json    every rank's per-rank parts: its torch / Python (/ CUDA) RNG state

Saving gathers one parameter at a time (DeepSpeed's safe_get_full_* under ZeRO ≥ 1) and keeps it
only on the data-parallel rank chosen to write it, so each rank holds about its ZeRO share of the
state on the CPU.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from train.checkpoint import files
from train.checkpoint.files import checkpoint_dir, step_tag
from train.checkpoint.optimizer_state import KINDS, ParameterState
from train.checkpoint.parts import CheckpointParts
from train.checkpoint.schema import FORMAT, FORMAT_VERSION
from train.checkpoint.storage import SaveFailed, first_cause

if TYPE_CHECKING:
    from model import GPTConfig
    from train.checkpoint import tensors


def save(engine, topology, model_cfg: GPTConfig, run_dir: Path, parts: CheckpointParts, *, keep: int = 3,
         keep_every: int = 0) -> Path:
    """Save the run into <run_dir>/checkpoints/step<step>/ (every rank calls it): the tensors, and the
    registered `parts` (which must save "step" and "tokens"). Then `latest` names it, and step folders
    beyond the newest `keep` are deleted, except steps that are multiples of `keep_every` (> 0).
    Returns the folder. `stage` then `write`, in this thread (train/checkpoint/writer.py runs the
    write in the background)."""
    return write(stage(engine, topology, model_cfg, run_dir, parts), keep=keep, keep_every=keep_every)


@dataclasses.dataclass
class Staged:
    """One rank's share of a checkpoint, taken from the run and no longer tied to it: what `write` puts
    on disk. `state` and `per_rank` (every rank's rng.json entry) are rank 0's alone (None elsewhere)."""

    tmp: Path  # the temporary folder the write fills, made (empty) by `stage`
    step: int
    slices: dict[str, tensors.FullSlice]
    state: dict | None
    per_rank: list | None


def stage(engine, topology, model_cfg: GPTConfig, run_dir: Path, parts: CheckpointParts, host_copy=None) -> Staged:
    """Everything a checkpoint of the run as it stands holds, gathered on every rank (collectives on
    the default process group), and the empty temporary folder it goes into (older leftovers removed).
    `host_copy(name, tensor) → tensor` makes this rank's tensors copies in host memory that training
    does not touch afterwards (for a write in the background); without it they are `.cpu()` (on the
    CPU the live tensors themselves), which a write must finish with before the next step changes them.
    SaveFailed on every rank when rank 0 cannot make the folder (a full disk, a folder turned read-only)."""
    import copy

    import torch.distributed as dist

    # every rank: a part's save may be a collective; copies, since a part's entries may be live objects
    shared, own = copy.deepcopy(parts.saved()), copy.deepcopy(parts.saved(per_rank=True))
    _check_plain(parts=shared)
    step = shared["step"]
    root = checkpoint_dir(run_dir)
    tmp = root / f"{files.TMP_PREFIX}{step_tag(step)}"
    rank, world = dist.get_rank(), dist.get_world_size()
    made = [None]  # rank 0's error making the folder, for every rank (a folder turned read-only, a full disk)
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            files.remove_leftovers(root)
            tmp.mkdir()
        except OSError as err:
            made = [_plain_error(err)]
    dist.broadcast_object_list(made, src=0)
    if made[0] is not None:
        raise SaveFailed(step, _os_error(made[0]))
    params = ParameterState(engine)
    params.ensure_state()
    slices = _collect(engine.module, model_cfg, topology, params, host_copy)
    adam_steps = _agreed(params.step_count(), "AdamW step count")
    per_rank = [None] * world
    dist.all_gather_object(per_rank, own)
    state = None
    if rank == 0:
        state = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "gpt3d": gpt3d_version(),
            "layout": layout_of(engine, topology), "model": dataclasses.asdict(model_cfg),
            "optimizer": {"adam_step": adam_steps}, **shared,
        }
    return Staged(tmp, step, slices, state, per_rank if rank == 0 else None)


def write(staged: Staged, *, keep: int = 3, keep_every: int = 0, group=None) -> Path:
    """Put a staged checkpoint on disk (every rank calls it; its collectives go over `group`, the
    default process group when None): each rank's safetensors file, fsynced, each rank hashing every
    world-th of them; then rank 0 writes state.json, rng.json and the manifest, renames the folder
    into place, replaces `latest` and applies retention. Every rank returns the folder once it is
    published, or raises SaveFailed when any rank failed (every rank alike, naming the first rank's error),
    after rank 0 removed the temporary folder: a failed save leaves the checkpoints as they were."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from train.checkpoint import tensors  # deferred: see train/checkpoint/tensors.py

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    root, tag, tmp = staged.tmp.parent, step_tag(staged.step), staged.tmp
    try:
        tensors.write(staged.slices, tmp, group=group)
    except CheckpointException as err:  # DCP gathered every rank's outcome: raised on every rank alike
        _discard(tmp, rank)
        raise SaveFailed(staged.step, first_cause([error for error, _ in err.failures.values()])) from None
    staged.slices = {}  # the host copies are not needed any more
    shard_files = sorted(p.name for p in tmp.glob(f"*{files.SHARD_SUFFIX}"))
    try:
        mine = ({name: files.describe(tmp / name) for name in shard_files[rank::world]}, None)
    except OSError as err:
        mine = ({}, _plain_error(err))
    described = [None] * world
    dist.all_gather_object(described, mine, group=group)
    failed = [error for _, error in described if error]
    outcome = [failed[0] if failed else None]
    if rank == 0 and not failed:
        try:
            _write_state(tmp, staged.state, {"ranks": staged.per_rank},
                         {k: v for d, _ in described for k, v in d.items()})
            files.publish(tmp, root / tag)
            files.set_latest(root, tag)
            files.prune(root, keep, keep_every, staged.step)
        except Exception as err:  # every rank must hear of it, not wait for rank 0 forever
            outcome = [_plain_error(err)]
    dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if outcome[0] is not None:
        _discard(tmp, rank)
        raise SaveFailed(staged.step, _os_error(outcome[0]))
    return root / tag


def _plain_error(err: Exception) -> tuple:
    """An error as plain values that any rank can unpickle: (errno, text, file name); errno None when it is
    not an OSError."""
    if isinstance(err, OSError) and err.errno is not None:
        return err.errno, err.strerror, err.filename
    return None, str(err) or repr(err), None


def _os_error(plain: tuple) -> Exception:
    """The error `_plain_error` described: an OSError with its errno, or a RuntimeError with its text."""
    number, text, filename = plain
    return OSError(number, text, filename) if number is not None else RuntimeError(text)


def _discard(tmp: Path, rank: int) -> None:
    """Rank 0: remove the temporary folder of a save that failed (on a read-only or vanished folder there
    is nothing to remove, or nothing that can be: the next start removes what is left)."""
    if rank == 0:
        try:
            files.remove(tmp)
        except OSError:
            pass


def _check_plain(**values) -> None:
    """JSON-able or a TypeError, on every rank before any collective (rank 0 alone writes them)."""
    try:
        json.dumps(values, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise TypeError(f"checkpoint: {', '.join(values)} must hold only dicts, lists, strings, finite numbers, "
                        f"booleans and None ({err})") from None


def _write_state(tmp: Path, state: dict, rng: dict, described: dict) -> None:
    for name, value in ((files.STATE, state), (files.RNG, rng)):
        files.write_json(tmp / name, value)
        described[name] = files.describe(tmp / name)
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": state["step"],
                "layout": state["layout"], "files": dict(sorted(described.items()))}
    files.write_json(tmp / files.MANIFEST, manifest)


def _collect(part, model_cfg: GPTConfig, topology, params: ParameterState, host_copy=None) -> dict[str, tensors.FullSlice]:
    """This rank's share of the tensors to save: for every parameter it speaks for (not a tied copy;
    tp rank 0 for replicated ones) whose data-parallel writer it is, the fp32 weights and moments of
    its region of the full tensor (vocabulary padding left out), through `host_copy` when given."""
    from train.checkpoint import tensors  # deferred: see train/checkpoint/tensors.py

    from parallel.naming import parameter_map

    spoken = [(local, shard) for local, shard in parameter_map(part, model_cfg, topology).items()
              if not shard.tied and (not shard.replicated or topology.tp_rank == 0)]
    writers = _writers([shard for _, shard in spoken], topology.dp_size)
    out = {}
    for (local, shard), writer in zip(spoken, writers):
        values = params.get(part.get_parameter(local))  # every dp rank takes part (ZeRO gathers)
        if writer != topology.dp_rank or tensors.is_empty(shard.index):
            continue
        offsets, _ = tensors.region(shard.index)
        for kind in KINDS:
            name, region = f"{kind}/{shard.name}", values[kind][shard.local_index]
            region = host_copy(name, region) if host_copy is not None else region.cpu()
            out[name] = tensors.FullSlice(region, shard.full_shape, offsets)
    return out


def _writers(shards: list, dp: int) -> list[int]:
    """The data-parallel rank that writes each shard: the least loaded so far, so each rank writes
    about 1/dp of the bytes (the same answer on every rank)."""
    from train.checkpoint import tensors  # deferred: see train/checkpoint/tensors.py

    load, writers = [0] * dp, []
    for shard in shards:
        _, sizes = tensors.region(shard.index)
        writer = min(range(dp), key=lambda r: load[r])
        load[writer] += max(1, int(torch.Size(sizes).numel()))
        writers.append(writer)
    return writers


def _agreed(value, what: str):
    """`value`, checked equal on every rank."""
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if len(set(values)) != 1:
        raise RuntimeError(f"ranks disagree on the {what}: {values}")
    return value


def layout_of(engine, topology) -> dict:
    return {"tp": topology.tp_size, "pp": topology.pp_size, "dp": topology.dp_size,
            "zero_stage": int(engine.zero_optimization_stage()), "offload_optimizer": bool(engine.zero_cpu_offload())}


def gpt3d_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpt3d")
    except PackageNotFoundError:
        return "unknown"
