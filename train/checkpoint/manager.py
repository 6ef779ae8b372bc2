"""Checkpoints that resume at any layout, are verified before use and never run code.

What a checkpoint holds (train/checkpoint/files.py shows the folder):

  tensors     for every full-model parameter (parallel/naming.py's names): its fp32 master
              weights ("model/<name>") and AdamW moments ("exp_avg/<name>", "exp_avg_sq/<name>"),
              each rank saving its tensor-parallel slice as a chunk of the full tensor, through
              torch.distributed.checkpoint into safetensors files (train/checkpoint/tensors.py)
  state.json  AdamW's step count, the model config, the layout, the gpt3d version, and the entries
              of the run's registered parts (train/checkpoint/parts.py): step and tokens, the data
              position, the LR schedule, DeepSpeed's step counters, the schedule record ("extra")
  rng.json    every rank's per-rank parts: its torch / Python (/ CUDA) RNG state

Saving gathers one parameter at a time (DeepSpeed's safe_get_full_* under ZeRO ≥ 1) and keeps
it only on the data-parallel rank chosen to write it, so each rank holds about its ZeRO share of
the state on the CPU. Loading asks DCP for exactly the regions this rank's layout needs, in
batches of about LOAD_BATCH_BYTES, and writes them back through DeepSpeed's safe_set_full_* (or
into the torch AdamW at ZeRO-0). So (tp, pp, dp, ZeRO stage, offload) may all differ between the
run that saved and the one that resumes.

The entry points: `find_resume_path` and `verified` (the resume checks), `load`, and `save`, which is
`stage` (gathering the state on every rank) then `write` (on disk, then published), the halves that
train/checkpoint/writer.py runs apart for a save in the background.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path

import torch

from train.checkpoint import files, schema, tensors
from train.checkpoint.optimizer_state import KINDS, ParameterState
from train.checkpoint.parts import CheckpointParts
from train.checkpoint.schema import FORMAT, FORMAT_VERSION
LOAD_BATCH_BYTES = 1 << 30  # fp32 state read per DCP load call on one rank
# Model config keys that do not change what the weights mean: a checkpoint need not match them.
RUN_ONLY_KEYS = ("name", "attention_impl", "deterministic_attention", "compile", "dropout", "init_std")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says which one and why."""


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


step_tag = files.step_tag


# ---------------------------------------------------------------------------------------------
# finding a checkpoint


def find_resume_path(resume, run_dir: Path) -> Path | None:
    """train.resume: 'auto' → the run dir's checkpoints/ folder when it holds any checkpoint (or a
    `latest`), else None (a fresh start); 'none'/null → None; else a path: a run directory, its
    checkpoints/ folder, or one step folder. Cheap: nothing is verified yet (`select` does that)."""
    if resume in (None, "none", "null", False):
        return None
    if resume == "auto":
        root = checkpoint_dir(run_dir)
        return root if _holds_checkpoints(root) else None
    path = Path(str(resume))
    for candidate in (path, checkpoint_dir(path)):
        if _is_step_folder(candidate) or _holds_checkpoints(candidate):
            return candidate
    raise ValueError(
        f"train.resume={resume!r}: no gpt3d checkpoint there (expected a run directory, its checkpoints/ folder, "
        f"or one step folder holding {files.MANIFEST}); use auto, none, overwrite, or such a path"
    )


def _holds_checkpoints(root: Path) -> bool:
    return bool(files.step_folders(root)) or (root / files.LATEST).exists()


def _is_step_folder(path: Path) -> bool:
    return path.is_dir() and ((path / files.MANIFEST).exists() or files.step_of(path) is not None)


def select(path: Path, verify=None, warn=None, before: Path | None = None) -> Path:
    """The checkpoint folder to use: `path` itself if it is a step folder, else the newest intact
    step folder under it (older than the step folder `before`, if given: one found damaged already);
    each damaged or incomplete one on the way is reported in one line (`warn`), and none intact is a
    CheckpointError. `verify(folder) → problems` defaults to a one-process check."""
    verify = verify or _verify_here
    warn = warn or print_warning
    path = Path(path)
    if _is_step_folder(path) and not _holds_checkpoints(path):
        problems = verify(path)
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged or incomplete: {'; '.join(problems)}")
        return path
    latest, latest_problem = files.read_latest(path)
    candidates = files.step_folders(path)
    if before is not None:  # `latest` was looked at when `before` was chosen
        candidates, latest, latest_problem = [f for f in candidates if files.step_of(f) < files.step_of(before)], None, None
    if latest_problem and candidates:
        warn(f"{path / files.LATEST} {latest_problem}; looking for the newest intact checkpoint in {path}")
    elif latest and not (path / latest).is_dir() and candidates:
        warn(f"{path / files.LATEST} names {latest}, which is missing; looking for the newest intact checkpoint")
    rejected = []
    for folder in candidates:
        problems = verify(folder)
        if not problems:
            return folder
        rejected.append(f"{folder.name}: {'; '.join(problems)}")
        warn(f"checkpoint {folder} is damaged or incomplete ({'; '.join(problems)}); trying the previous one")
    named = f"; {files.LATEST} names {latest}, which is missing" if latest and not (path / latest).is_dir() else ""
    raise CheckpointError(
        f"no intact checkpoint in {path} ({'; '.join(rejected) or 'no step folders'}{named}); move the damaged "
        f"ones away, resume from another path (train.resume=<path>), or start a new run (train.resume=none or "
        f"another run directory)"
    )


def verified(path: Path, warn=None) -> tuple[Path, dict]:
    """`select` in this process (no process group needed) on everything but the tensor shards' bytes:
    structure, the checksums of state.json and rng.json, the schema, the shard headers and their
    tiling; returns the chosen folder and its state.json as that check read it. The shards' checksums
    are checked by `load`, shared by all ranks: hashing them here would read the whole checkpoint in
    every process."""
    states = {}

    def verify(folder: Path) -> list[str]:
        problems, states[folder] = _checked_here(folder, hash_shards=False)
        return problems

    folder = select(path, verify=verify, warn=warn)
    return folder, states[folder]


def _verify_here(folder: Path) -> list[str]:
    return _checked_here(folder)[0]


def _checked_here(folder: Path, hash_shards: bool = True) -> tuple[list[str], dict | None]:
    """(problems, state.json when there are none) of a folder, checked in this process."""
    manifest, problems = files.structure_problems(folder)
    if problems:
        return problems, None
    problems = files.digest_problems(folder, manifest, sorted(manifest["files"]), hash_shards)
    return (problems, None) if problems else _content_problems(folder, manifest)


def _shards_together(folder: Path) -> list[str]:
    """The shard files' checksums (a folder `verified` passed), the hashing shared by all ranks."""
    manifest, _ = files.structure_problems(folder)
    return _digests_together(folder, manifest, [n for n in manifest["files"] if n.endswith(files.SHARD_SUFFIX)])


def _digests_together(folder: Path, manifest: dict, names: list[str]) -> list[str]:
    """`files.digest_problems` of `names`, each rank hashing every world-th one; every rank returns the
    same problems."""
    import torch.distributed as dist

    problems = files.digest_problems(folder, manifest, sorted(names)[dist.get_rank()::dist.get_world_size()])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    return sorted({p for ps in gathered for p in ps})


def _verify_together(folder: Path) -> list[str]:
    """`_verify_here` with the hashing shared by all ranks (each hashes every world-th file); every
    rank returns the same problems."""
    manifest, problems = files.structure_problems(folder)
    problems = _digests_together(folder, manifest, list(manifest["files"]) if not problems else [])
    return problems or _content_problems(folder, manifest)[0]


def _content_problems(folder: Path, manifest: dict) -> tuple[list[str], dict | None]:
    """(problems, state.json when there are none) of what an intact folder's files say
    (train/checkpoint/schema.py): state.json and rng.json, and the tensors of the model state.json
    describes, from the shard headers (each present, fp32, its chunks tiling it exactly once). Cheap:
    no tensor data is read."""
    from model import GPTConfig

    try:
        state = files.read_json(folder / files.STATE)
        rng = files.read_json(folder / files.RNG)
    except (OSError, ValueError):
        return ["state.json or rng.json is not valid JSON"], None
    problem = (schema.state_problem(state, files.step_of(folder))
               or schema.rng_problem(rng, torch.get_rng_state().numel()))
    if problem:
        return [problem], None
    try:
        model_cfg = GPTConfig(**state["model"])  # its keys are GPTConfig's fields (schema)
    except (TypeError, ValueError) as err:
        return [f"state.json: model describes no valid model ({err})"], None
    shard_files = sorted(name for name in manifest["files"] if name.endswith(files.SHARD_SUFFIX))
    problems = tensors.layout_problems(folder, shard_files, saved_shapes(model_cfg))
    return ([f"tensors: {'; '.join(problems[:3])}"], None) if problems else ([], state)


def checked_state(folder: Path) -> dict:
    """state.json of a checkpoint folder that `select` chose (so verified), checked again against the
    schema as it is read; CheckpointError naming the field otherwise."""
    try:
        state = files.read_json(Path(folder) / files.STATE)
    except (OSError, ValueError):
        raise CheckpointError(f"{Path(folder) / files.STATE} is not valid JSON") from None
    problem = schema.state_problem(state, files.step_of(folder))
    if problem:
        raise CheckpointError(f"checkpoint {folder}: {problem}")
    return state


def print_warning(text: str) -> None:
    print(f"gpt3d: warning: {text}", file=sys.stderr, flush=True)


def tag_folder(path: Path) -> Path:
    """The intact checkpoint folder `path` names (one process): a run directory or its checkpoints/
    folder (the newest intact one), or one step folder. ValueError if there is none."""
    path = Path(path)
    for root in (checkpoint_dir(path), path):
        if _holds_checkpoints(root) or _is_step_folder(root):
            return select(root)
    raise ValueError(
        f"{str(path)!r} holds no checkpoint: give a run directory, its checkpoints/ folder or one step folder "
        f"(with {files.MANIFEST})"
    )


# ---------------------------------------------------------------------------------------------
# saving


def save(engine, topology, model_cfg, run_dir: Path, parts: CheckpointParts, *, keep: int = 3,
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


def stage(engine, topology, model_cfg, run_dir: Path, parts: CheckpointParts, host_copy=None) -> Staged:
    """Everything a checkpoint of the run as it stands holds, gathered on every rank (collectives on
    the default process group), and the empty temporary folder it goes into (older leftovers removed).
    `host_copy(name, tensor) → tensor` makes this rank's tensors copies in host memory that training
    does not touch afterwards (for a write in the background); without it they are `.cpu()` (on the
    CPU the live tensors themselves), which a write must finish with before the next step changes them."""
    import copy

    import torch.distributed as dist

    # every rank: a part's save may be a collective; copies, since a part's entries may be live objects
    shared, own = copy.deepcopy(parts.saved()), copy.deepcopy(parts.saved(per_rank=True))
    _check_plain(parts=shared)
    step = shared["step"]
    root = checkpoint_dir(run_dir)
    tmp = root / f"{files.TMP_PREFIX}{step_tag(step)}"
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        files.remove_leftovers(root)
        tmp.mkdir()
    dist.barrier()
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
    published, or raises CheckpointError when any rank failed (every rank alike)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    root, tag, tmp = staged.tmp.parent, step_tag(staged.step), staged.tmp
    tensors.write(staged.slices, tmp, group=group)
    staged.slices = {}  # the host copies are not needed any more
    shard_files = sorted(p.name for p in tmp.glob(f"*{files.SHARD_SUFFIX}"))
    try:
        mine = ({name: files.describe(tmp / name) for name in shard_files[rank::world]}, None)
    except OSError as err:
        mine = ({}, f"rank {rank} cannot hash its files ({err})")
    described = [None] * world
    dist.all_gather_object(described, mine, group=group)
    failed = [error for _, error in described if error]
    outcome = ["; ".join(failed) or None]
    if rank == 0 and not failed:
        try:
            _write_state(tmp, staged.state, {"ranks": staged.per_rank},
                         {k: v for d, _ in described for k, v in d.items()})
            files.publish(tmp, root / tag)
            files.set_latest(root, tag)
            files.prune(root, keep, keep_every, staged.step)
        except Exception as err:  # every rank must hear of it, not wait for rank 0 forever
            outcome = [str(err) or repr(err)]
    dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if outcome[0] is not None:
        raise CheckpointError(f"the checkpoint of step {staged.step} could not be written: {outcome[0]}")
    return root / tag


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


def _collect(part, model_cfg, topology, params: ParameterState, host_copy=None) -> dict[str, tensors.FullSlice]:
    """This rank's share of the tensors to save: for every parameter it speaks for (not a tied copy;
    tp rank 0 for replicated ones) whose data-parallel writer it is, the fp32 weights and moments of
    its region of the full tensor (vocabulary padding left out), through `host_copy` when given."""
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


# ---------------------------------------------------------------------------------------------
# loading


def load(engine, topology, model_cfg, path: Path, parts: CheckpointParts, known: tuple[Path, dict] | None = None
         ) -> tuple[Path, dict]:
    """Resume from `path` (find_resume_path's answer) at this run's layout, whatever layout saved it
    (every rank calls it): model, fp32 master weights, Adam moments and step count, then every
    registered part (this rank's per-rank ones last). `known`: the (folder, state.json) that the
    resume checks chose under `path` and verified in every process but for the shards' checksums
    (`verified`): those are checked here by all ranks together, and that folder is loaded. Without
    it, or when its shards are damaged, the checkpoint is verified here, a damaged one reported and
    the previous intact one used; a previous one that records another schedule than `known`'s (which
    the run was resolved from) is a CheckpointError. Returns (the folder used, its state.json)."""
    import torch.distributed as dist

    quiet = dist.get_rank() != 0
    warn = (lambda text: None) if quiet else print_warning
    problems = _shards_together(known[0]) if known is not None else []
    if known is not None and not problems:
        folder, state = known
    else:
        before = None
        if known is not None:
            before = known[0]
            warn(f"checkpoint {before} is damaged or incomplete ({'; '.join(problems)}); trying the previous one")
            if not _holds_checkpoints(Path(path)):  # train.resume named that one step folder
                raise CheckpointError(f"checkpoint {before} is damaged or incomplete: {'; '.join(problems)}")
        folder = select(path, verify=_verify_together, warn=warn, before=before)
        state = checked_state(folder)
        if known is not None and state.get("extra") != known[1].get("extra"):
            raise CheckpointError(
                f"checkpoint {known[0]} passed the checks before the build but its tensor files are damaged, and "
                f"the previous intact one, {folder}, records another schedule; move {known[0]} away and start again")
    check_model(state["model"], model_cfg, folder)
    reader = tensors.ShardReader(folder)
    params = ParameterState(engine)
    params.ensure_state()
    _restore(engine.module, model_cfg, topology, params, reader)
    params.set_step_count(state["optimizer"]["adam_step"])
    parts.load(state)
    ranks = files.read_json(folder / files.RNG)["ranks"]
    parts.load(ranks[dist.get_rank() % len(ranks)], per_rank=True)  # the same rank's at the same layout
    return folder, state


def check_model(saved: dict, model_cfg, folder: Path) -> None:
    """One error naming every model setting that differs from the checkpoint's."""
    differing = model_differences(saved, model_cfg)
    if differing:
        raise CheckpointError(
            f"checkpoint {folder} holds another model: it was saved with "
            + ", ".join(f"model.{k}={saved.get(k)!r} (now {getattr(model_cfg, k, None)!r})" for k in differing)
            + "; resume with the same model settings, or start a new run"
        )


def model_differences(saved: dict, model_cfg) -> list[str]:
    """Model config keys whose saved value differs from `model_cfg`'s (run-only keys aside)."""
    current = dataclasses.asdict(model_cfg)
    keys = (set(saved) | set(current)) - set(RUN_ONLY_KEYS)
    return sorted(k for k in keys if saved.get(k) != current.get(k))


def saved_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """{saved tensor name: full shape} of a checkpoint of this model."""
    from parallel.naming import full_shapes

    return {f"{kind}/{name}": shape for name, shape in full_shapes(model_cfg).items() for kind in KINDS}


def _restore(part, model_cfg, topology, params: ParameterState, reader: tensors.ShardReader) -> None:
    """Every local parameter (each Parameter once) from its region of the saved full tensors, in
    batches; every rank makes the same number of DCP calls (a collective), some with nothing to read."""
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


# ---------------------------------------------------------------------------------------------
# reading in one process (generation, export)


def saved_model_config(folder: Path) -> dict:
    """The model config a (verified) checkpoint folder was saved with."""
    return checked_state(folder)["model"]


def read_model_weights(folder: Path, config) -> dict[str, torch.Tensor]:
    """{full parameter name: fp32 tensor} of the whole model from a checkpoint folder that `select`
    verified (so its tensors tile this model exactly), written at any layout, in this process (no
    process group needed)."""
    from parallel.naming import full_shapes

    reader = tensors.ShardReader(folder)
    requests = {f"model/{name}": torch.empty(shape) for name, shape in full_shapes(config).items()}
    with warnings.catch_warnings():  # DCP's note that it reads in one process: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        tensors.read(requests, reader, distributed=False)
    return {name.removeprefix("model/"): tensor for name, tensor in requests.items()}
