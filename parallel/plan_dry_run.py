"""Dry run: build every distinct rank's shard of the real model on the meta device, and check that
the shards cover every parameter of the full model exactly once.

Ranks that differ only in their data-parallel coordinate hold identical shards, so the distinct
shards are the tp × pp pairs (tp rank, pipeline stage). Each is built by the project's own build
code inside a *fake* process group (torch's "fake" backend: a rank of a world of tp·pp processes
that never communicates), so nothing is allocated and no other process exists.

Coverage: every built parameter is a piece of one full parameter (its name and the rows or columns
it holds). A tensor-parallel replica (a LayerNorm on every tp rank) and the pipeline's second copy of
the tied embedding are counted once, by tp rank 0 and by the first stage. The check: the counted
pieces of each full parameter are disjoint, together span it (vocabulary padding aside), and their
sizes add up to the full model's exact parameter count; and each shard's parameters equal
`plan_counts.rank_parameters` (names, shapes, order).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model import GPT, GPTConfig, count_parameters
from parallel.plan_counts import ParamShape, rank_parameters


@dataclass(frozen=True)
class Piece:
    """One built parameter: which full parameter it is a piece of, and which part (dim, start, stop);
    dim is None for a whole (unsharded) parameter."""

    name: str
    shape: tuple[int, ...]
    dim: int | None
    start: int
    stop: int
    owner: bool


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
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _build_rank_shard(model_cfg: GPTConfig, tp: int, pp: int) -> torch.nn.Module:
    """This (fake) rank's part of the model, on meta, built by today's build code: a tensor-parallel
    GPT for pp = 1, a DeepSpeed PipelineModule stage for pp > 1.

    The one place that knows how the project builds a layout; when parallel/ gains a single build
    function for every layout, call it here (on the meta device, without initialisation). Until then
    the pipeline path is run with two things turned off that a meta build cannot do: drawing the
    initial weights and PipelineModule's move to the accelerator.
    """
    from unittest import mock

    from parallel.topology import Topology

    topology = Topology.create(tp, pp)
    if pp == 1:
        from parallel.tensor import shard

        with torch.device("meta"):
            model = GPT(model_cfg)
        return shard(model, topology)
    from deepspeed.runtime.pipe.module import PipelineModule

    from parallel import pipeline

    with contextlib.redirect_stdout(open(os.devnull, "w")), \
            mock.patch.object(pipeline, "init_layer_", lambda *args, **kwargs: None), \
            mock.patch.object(PipelineModule, "to", lambda self, *args, **kwargs: self):  # fmt: skip
        return pipeline.build_pipeline(model_cfg, topology, seed=0, device=torch.device("meta"))


def _full_name(built_name: str, n_layer: int) -> str:
    """The full GPT's name of a built parameter (PipelineModule names layers by spec index and keeps
    the tied embedding under tied_modules)."""
    if built_name.startswith("tied_modules.embedding."):
        return "layers.0." + built_name.removeprefix("tied_modules.embedding.")
    match = re.fullmatch(r"(\d+)\.(.+)", built_name)
    return f"layers.{match[1]}.{match[2]}" if match else built_name


def shard_pieces(module: torch.nn.Module, n_layer: int, tp_rank: int, stage: int) -> list[Piece]:
    """The pieces a built shard holds, in its parameters() order. The slice comes from the sharding
    hints parallel/tensor.py leaves on every split parameter (`shard_of`: dim, rank, size)."""
    pieces = []
    for name, param in module.named_parameters():
        full = _full_name(name, n_layer)
        hint = getattr(param, "shard_of", None)
        replicated_pipe = getattr(param, "ds_pipe_replicated", False)
        if hint is None:
            pieces.append(Piece(full, tuple(param.shape), None, 0, param.shape[0], tp_rank == 0 and not replicated_pipe))
            continue
        dim, rank = hint.keywords["dim"], hint.keywords["rank"]
        step = param.shape[dim]
        pieces.append(Piece(full, tuple(param.shape), dim, rank * step, (rank + 1) * step, not replicated_pipe))
    return pieces


def _compare(pieces: list[Piece], expected: list[ParamShape], where: str) -> list[str]:
    got = [(p.name, p.shape) for p in pieces]
    want = [(p.name, p.shape) for p in expected]
    if got == want:
        return []
    return [f"{where}: built {got[:4]}… ({len(got)} parameters) ≠ counted {want[:4]}… ({len(want)})"]


def _coverage(pieces: list[Piece], full: dict[str, torch.Size]) -> tuple[int, list[str]]:
    """Elements of the full model the owned pieces cover, and every overlap, gap or stray piece."""
    problems, covered = [], 0
    by_name: dict[str, list[Piece]] = {}
    for piece in pieces:
        if piece.owner:
            by_name.setdefault(piece.name, []).append(piece)
    for name in sorted(set(by_name) - set(full)):
        problems.append(f"{name}: built but not a parameter of the full model")
    for name, shape in full.items():
        owned = sorted(by_name.get(name, []), key=lambda p: p.start)
        if not owned:
            problems.append(f"{name}: no shard holds it")
            continue
        if owned[0].dim is None:
            if len(owned) > 1 or owned[0].shape != tuple(shape):
                problems.append(f"{name}: held whole {len(owned)} times, shapes {[p.shape for p in owned]}")
            covered += shape.numel()
            continue
        dim, extent, position = owned[0].dim, shape[owned[0].dim], 0
        for piece in owned:
            if piece.start != position:
                problems.append(f"{name}: pieces along dim {dim} jump from {position} to {piece.start}")
            position = piece.stop
            rows = max(0, min(piece.stop, extent) - piece.start)  # rows past the extent are padding
            covered += shape.numel() // extent * rows
        if position < extent:
            problems.append(f"{name}: pieces cover {position} of {extent} along dim {dim}")
    return covered, problems


def dry_run(model_cfg: GPTConfig, tp: int, pp: int, log=None) -> DryRunReport:
    """Build all tp·pp distinct shards on meta and check their coverage (see module docstring)."""
    started = time.perf_counter()
    with torch.device("meta"):
        full_model = GPT(model_cfg)
    full = {name: p.shape for name, p in full_model.named_parameters()}
    pieces, problems = [], []
    for stage in range(pp):
        expected = rank_parameters(model_cfg, tp, pp, stage)
        for tp_rank in range(tp):
            with _fake_world(stage * tp + tp_rank, tp * pp):
                shard = _build_rank_shard(model_cfg, tp, pp)
                built = shard_pieces(shard, model_cfg.n_layer, tp_rank, stage)
            problems += _compare(built, expected, f"stage {stage}, tp rank {tp_rank}")
            pieces += built
        if log is not None:
            log(f"dry run: stage {stage + 1}/{pp} built ({tp} tensor-parallel shards)")
    covered, coverage_problems = _coverage(pieces, full)
    return DryRunReport(
        shards=tp * pp,
        full_parameters=count_parameters(full_model),
        covered_parameters=covered,
        seconds=time.perf_counter() - started,
        problems=problems + coverage_problems,
    )
