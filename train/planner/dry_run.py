"""Dry run: build every distinct rank's shard of the real model on the meta device, and check that
the shards cover every parameter of the full model exactly once.

Ranks that differ only in their data-parallel coordinate hold identical shards, so the distinct
shards are the tp × pp pairs (tp rank, pipeline stage). Each is built by the project's one build
function, `parallel.build.build_model(..., device="meta")` (structure only: nothing allocated,
nothing initialised), inside a *fake* process group (torch's "fake" backend: a rank of a world of
tp·pp processes that never communicates), so no other process exists.

Coverage: the naming API (`parallel.naming.parameter_map`) says which full parameter each built
parameter is a piece of, and which region of it. A tensor-parallel replica (a LayerNorm on every tp
rank) is counted by tp rank 0 only, and the tied unembedding (the last stage's copy, or the
one-process model's second name for the matrix) not at all: its owner is the token embedding. The
check: the counted regions of each full parameter are disjoint, together span it (vocabulary
padding is no part of any region), and their sizes add up to the full model's exact parameter
count; and each shard's parameters equal `plan_counts.rank_parameters` (names, shapes, order, and
which ones DeepSpeed reduces in bf16 under autocast).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model import GPT, GPTConfig, count_parameters
from parallel.naming import Shard, parameter_map
from train.planner.counts import ParamShape, chunked_rank_parameters


@dataclass
class DryRunReport:
    """What the dry run built and checked."""

    shards: int
    full_parameters: int
    covered_parameters: int
    seconds: float
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems and self.covered_parameters == self.full_parameters


@contextlib.contextmanager
def _fake_world(rank: int, world_size: int):
    """This process as `rank` of a fake process group of `world_size` ranks (no communication)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the dry run needs a process without a process group (run it outside a launch)")
    launch = {"LOCAL_RANK": "0", "DS_ACCELERATOR": "cpu"}
    unset = [key for key in launch if key not in os.environ]
    for key in unset:
        os.environ[key] = launch[key]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for key in unset:  # the caller's environment as it was: a later library must not see a launch
            del os.environ[key]


def _build_rank_shard(model_cfg: GPTConfig, tp: int, pp: int, split):
    """This (fake) rank's part of the model and its topology: parallel.build_model on meta."""
    from parallel.build import BuildOptions, build_model
    from parallel.topology import Topology

    topology = Topology.create(tp, pp)
    return build_model(model_cfg, topology, seed=0, device="meta", options=BuildOptions(stages=split)), topology


def _compare(part: torch.nn.Module, shards: dict[str, Shard], expected: tuple[ParamShape, ...],
             where: str) -> list[str]:
    """The part's parameters (unique, in order) against what the planner counts for its rank: full
    name, local shape, and whether DeepSpeed's autocast would reduce its gradient in bf16 (it belongs
    to a module of a class DeepSpeed lists as safe in lower precision)."""
    from deepspeed.runtime.torch_autocast import LOWER_PRECISION_SAFE_MODULES

    lower = {id(p) for m in part.modules() if m.__class__ in LOWER_PRECISION_SAFE_MODULES for p in m.parameters(False)}
    got = [(shards[name].name, shards[name].local_shape, id(p) in lower) for name, p in part.named_parameters()]
    want = [(p.name, p.shape, p.linear) for p in expected]
    if got == want:
        return []
    i = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
    built, count = (got[i] if i < len(got) else "nothing"), (want[i] if i < len(want) else "nothing")
    return [f"{where}: parameter {i} built {built} ≠ counted {count} ({len(got)} built, {len(want)} counted)"]


def counted(shards: dict[str, Shard], tp_rank: int) -> list[Shard]:
    """The shards of one rank that count towards the full model: not the tied copy, and a replicated
    parameter only on tp rank 0."""
    return [s for s in shards.values() if not s.tied and (not s.replicated or tp_rank == 0)]


def coverage(pieces: list[Shard], full: dict[str, tuple[int, ...]]) -> tuple[int, list[str]]:
    """Elements of the full model the counted pieces cover, and every overlap, gap or stray piece."""
    problems, covered = [], 0
    by_name: dict[str, list[Shard]] = {}
    for piece in pieces:
        by_name.setdefault(piece.name, []).append(piece)
    for name in sorted(set(by_name) - set(full)):
        problems.append(f"{name}: built but not a parameter of the full model")
    for name, shape in full.items():
        held = by_name.get(name, [])
        if not held:
            problems.append(f"{name}: no shard holds it")
            continue
        if {p.split_dim for p in held} == {None}:
            if len(held) > 1 or held[0].full_shape != tuple(shape):
                problems.append(f"{name}: held whole {len(held)} times, shapes {[p.full_shape for p in held]}")
            covered += math.prod(shape)
            continue
        dims = {p.split_dim for p in held}
        if len(dims) > 1:
            problems.append(f"{name}: pieces split along different dims {sorted(dims, key=str)}")
            continue
        dim, position = dims.pop(), 0
        for piece in sorted(held, key=lambda p: p.index[dim].start):
            region = piece.index[dim]
            if region.start != position:
                problems.append(f"{name}: pieces along dim {dim} jump from {position} to {region.start}")
            others = [s for d, s in enumerate(piece.index) if d != dim]
            if others != [slice(0, n) for d, n in enumerate(shape) if d != dim]:
                problems.append(f"{name}: a piece holds {piece.index}, not all of the other dims of {tuple(shape)}")
            position = region.stop
            covered += math.prod(shape) // shape[dim] * (region.stop - region.start)
        if position != shape[dim]:
            problems.append(f"{name}: pieces cover {position} of {shape[dim]} along dim {dim}")
    return covered, problems


def dry_run(model_cfg: GPTConfig, tp: int, pp: int, log=None, split=None) -> DryRunReport:
    """Build all tp·pp distinct shards on meta and check their coverage (see module docstring); `split`: the
    pipeline's stages (parallel.pipeline.StageSplit: its virtual stages and their blocks), None for one
    chunk a rank balanced by count."""
    from parallel.pipeline import StageSplit
    from parallel.schedules.placement import Placement

    split = split or StageSplit(Placement(pp))
    started = time.perf_counter()
    with torch.device("meta"):
        full_model = GPT(model_cfg)  # the one-process model: the names and shapes to cover
    # the shapes checkpoints name: the padded vocabulary's (V, d), not its (Vp, d) storage (model/vocab.py)
    full = {name: tuple(getattr(p, "full_shape", p.shape)) for name, p in full_model.named_parameters()}
    pieces, problems = [], []
    for stage in range(pp):
        expected = chunked_rank_parameters(model_cfg, tp, split.placement, stage, split.blocks)
        for tp_rank in range(tp):
            where = f"stage {stage}, tp rank {tp_rank}"
            with _fake_world(stage * tp + tp_rank, tp * pp):  # DeepSpeed's rank order: pipe, data, model
                part, topology = _build_rank_shard(model_cfg, tp, pp, split)
                if (topology.pp_rank, topology.tp_rank) != (stage, tp_rank):
                    placed = f"stage {topology.pp_rank}, tp rank {topology.tp_rank}"
                    raise RuntimeError(f"{where}: the fake rank is ({placed})")
                try:
                    shards = parameter_map(part, model_cfg, topology)  # checks every local shape too
                except (KeyError, ValueError) as error:  # a parameter the naming API cannot place
                    problems.append(f"{where}: {error}")
                    continue
            problems += _compare(part, shards, expected, where)
            pieces += counted(shards, tp_rank)
        if log is not None:
            log(f"dry run: stage {stage + 1}/{pp} built ({tp} tensor-parallel shards)")
    covered, coverage_problems = coverage(pieces, full)
    return DryRunReport(
        shards=tp * pp,
        full_parameters=count_parameters(full_model),
        covered_parameters=covered,
        seconds=time.perf_counter() - started,
        problems=problems + coverage_problems,
    )
