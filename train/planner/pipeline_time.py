"""The pipeline part of the planner's step: how long m micro batches take through the stages under each
schedule, and what a rank holds at its activation peak (parallel/schedules/ runs the schedules).

Each pipeline rank is timed as the slowest one, whose micro batch takes `Passes` F + B + W = T over all
its chunks (V of them; a chunk's passes are T/V), p ranks, m micro batches a step:

  1f1b          (m + p − 1)·T
  zb-h1, m ≥ p  m·T + (p − 1)·(F + B − min(W, F, B))      (W ≤ min(F, B): Qi et al.'s (p − 1)(F + B − W))
  zb-h1, m < p  max(p·(F + B) + (m − 1)·(max(F, W) + B) + W,  (p − 1)·F + m·T)
  interleaved   m·T + (p − 1)·T/V                         (Narayanan et al.'s (p − 1)/(V·m) of m·T)
  zb-v          the order the engine runs (its list schedule, built for the passes' shares) played with the
                chunks' passes (F/2, B/2, W/2): at least m·T + (p − 1)·F/2

Each closed form is the step of the order the engine runs, as parallel.schedules.orders.timeline times it
(tests/train/planner/test_plan_schedules.py). At the peak a rank holds its forwards' activations until
their B, and under the schedules that split W off (zb-h1, zb-v) each B's deferred inputs until its W:
closed forms for one chunk a rank (`held_at_peak`), the walk of the rank's own order for several
(`chunks_held_at_peak`), exact for the order the engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from parallel.schedules.orders import (
    FORWARD,
    INPUT_GRAD,
    INTERLEAVED,
    ONE_F_ONE_B,
    WEIGHT_GRAD,
    ZB_H1,
    ZB_V,
    Costs,
    interleaved,
    list_orders,
    placement_of,
    timeline,
)
from parallel.schedules.placement import Placement


@dataclass(frozen=True)
class Passes:
    """Seconds of one micro batch on a rank, all its chunks, by pass: the forward F, the input gradient B (the
    whole backward but W) and the weight gradients W."""

    forward: float
    input_grad: float
    weight_grad: float

    @property
    def total(self) -> float:
        return self.forward + self.input_grad + self.weight_grad

    def scaled_to(self, seconds: float) -> Passes:
        """The same shares of `seconds` (a micro batch bound by its host time)."""
        ratio = seconds / self.total
        return Passes(self.forward * ratio, self.input_grad * ratio, self.weight_grad * ratio)

    def shares(self) -> tuple[float, float, float]:
        """F, B and W as shares of their sum, to two digits: the costs a schedule orders its passes by (the
        order hardly changes between them, and the planner's cache of orders then serves a search)."""
        return tuple(round(x / self.total, 2) for x in (self.forward, self.input_grad, self.weight_grad))

    def __add__(self, other: Passes) -> Passes:
        return Passes(self.forward + other.forward, self.input_grad + other.input_grad,
                      self.weight_grad + other.weight_grad)


def pipeline_seconds(schedule: str, placement: Placement, micro_batches: int, passes: Passes) -> float:
    """Seconds from the first forward to the last pass of m micro batches through `placement`'s ranks, each
    taking `passes` per micro batch (see the module docstring); with p = 1 every schedule takes m·T."""
    p, m, whole = placement.pp, micro_batches, passes.total
    f, b, w = passes.forward, passes.input_grad, passes.weight_grad
    if p == 1:
        return m * whole
    if schedule == ONE_F_ONE_B:
        return (m + p - 1) * whole
    if schedule == ZB_H1:  # the order the engine runs, built for these passes' shares
        if m >= p:
            return m * whole + (p - 1) * (f + b - min(w, f, b))
        return max(p * (f + b) + (m - 1) * (max(f, w) + b) + w, (p - 1) * f + m * whole)
    if schedule == INTERLEAVED:
        return m * whole + (p - 1) * whole / placement.virtual
    shares = Costs(*passes.shares())
    played = timeline(zb_v_orders(p, m, shares), Costs(f / 2, b / 2, w / 2))  # a chunk: half the rank's passes
    return max(rank[-1][4] for rank in played)


@lru_cache(maxsize=256)
def zb_v_orders(p: int, m: int, shares: Costs) -> list:
    """The orders ScheduleEngine runs under zb-v for passes of these shares (RunSpec.pass_costs)."""
    return list_orders(placement_of(ZB_V, p), m, shares)


@dataclass(frozen=True)
class PipelineTime:
    """The pipeline part of a step: m micro batches through the layout's ranks under its schedule, every rank
    timed as `slowest`, the rank with the largest F + B + W."""

    micro_batches: int
    slowest: object  # the slowest rank's RankPlan (train/planner/results.py)
    seconds: float  # pipeline_seconds

    @property
    def passes(self) -> Passes:
        return self.slowest.passes

    @property
    def bubble_s(self) -> float:
        """The slowest rank's idle time: the pipeline's seconds less its m micro batches."""
        return self.seconds - self.micro_batches * self.passes.total

    @property
    def bubble(self) -> float:
        """The bubble's share of the pipeline's seconds (pipeline_seconds)."""
        return self.bubble_s / self.seconds


def held_at_peak(schedule: str, pp: int, micro_batches: int, stage: int, saved: int, deferred: int) -> tuple[int, int]:
    """(micro batches whose activations, W passes whose inputs and output gradients) `stage` holds at its
    activation peak under 1f1b or zb-h1 (one chunk a rank), each micro batch `saved` bytes and each W pass
    `deferred`. 1F1B and DeepSpeed's engine keep i = min(pp − s, m) micro batches in flight (1 without a
    pipeline) and defer nothing. ZB-H1 keeps the same i, and its stage s runs a W once it holds more than s
    (parallel.schedules.orders.zb_h1), so the peak is the larger of just after a forward, (i, min(s, m − i)),
    and just after a B, (i − 1, min(s + 1, m − i + 1)): exact for the order the engine runs, at every pp and m."""
    m = micro_batches
    if pp == 1:
        return 1, 0
    in_flight = min(pp - stage, m)
    if schedule != ZB_H1:
        return in_flight, 0
    after_forward = (in_flight, min(stage, m - in_flight))
    after_input_grad = (in_flight - 1, min(stage + 1, m - in_flight + 1))
    return max(after_forward, after_input_grad, key=lambda held: held[0] * saved + held[1] * deferred)


def chunks_held_at_peak(schedule: str, placement: Placement, micro_batches: int, rank: int, saved: dict[int, tuple],
                        deferred: dict[int, int], shares: Costs = Costs()) -> tuple[tuple, int, int, int]:
    """What `rank` holds at its activation peak under the interleaved schedule or zb-v, walking its own order:
    saved[v] = (activation bytes, weight-copy bytes) of one micro batch on its virtual stage v, deferred[v]
    the bytes of one W pass there (empty: none deferred). Returns ((activation bytes, weight-copy bytes),
    W bytes, chunk micro batches in flight, W passes held), at the first moment the sum of the bytes is
    largest; `shares`: the passes' shares zb-v's order was built for."""
    forwarded, deferring = _held_counts(schedule, placement, micro_batches, rank, shares)
    own = placement.stages_of(rank)
    activations = forwarded @ np.array([saved[v][0] for v in own], dtype=np.int64)
    copies = forwarded @ np.array([saved[v][1] for v in own], dtype=np.int64)
    held_w = deferring @ np.array([deferred.get(v, 0) for v in own], dtype=np.int64)
    t = int(np.argmax(activations + copies + held_w))
    return ((int(activations[t]), int(copies[t])), int(held_w[t]), int(forwarded[t].sum()),
            int(deferring[t].sum()) if deferred else 0)


def _held_counts(schedule: str, placement: Placement, micro_batches: int, rank: int, shares: Costs
                 ) -> tuple[np.ndarray, np.ndarray]:
    """After each pass of `rank`'s order, per chunk (its virtual stages in order): the micro batches forwarded
    and not yet through B, and those through B and not yet through W."""
    if schedule == INTERLEAVED:
        return _interleaved_counts(placement, micro_batches, rank)
    return _zb_v_counts(placement.pp, micro_batches, rank, shares)


def _interleaved_counts(placement: Placement, micro_batches: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """`_held_counts` of parallel.schedules.orders.interleaved's order, built as arrays: the k-th forward runs
    chunk (k mod pp·V) div pp and the k-th backward chunk V − 1 − that (a search meets thousands of these)."""
    pp, chunks = placement.pp, placement.virtual
    order = interleaved(placement, micro_batches, rank) if chunks == 1 else None
    total = micro_batches * chunks
    if order is not None:  # one chunk: 1F1B's order
        kinds = np.array([1 if kind == FORWARD else -1 for kind, _, _ in order])
        index = np.zeros(len(order), dtype=np.int64)
    else:
        warmup = min((pp - rank - 1) * 2 + (chunks - 1) * pp, total)
        forward = (np.arange(total) % (pp * chunks)) // pp  # the chunk of each forward, in order
        backward = chunks - 1 - forward
        steady = total - warmup
        index = np.concatenate([forward[:warmup], np.stack([forward[warmup:], backward[:steady]], 1).reshape(-1),
                                backward[steady:]])
        kinds = np.concatenate([np.ones(warmup, dtype=np.int64), np.tile([1, -1], steady),
                                -np.ones(total - steady, dtype=np.int64)])
    delta = np.zeros((len(index) + 1, chunks), dtype=np.int64)
    delta[np.arange(1, len(index) + 1), index] = kinds
    return np.cumsum(delta, axis=0), np.zeros_like(delta)


@lru_cache(maxsize=256)
def _zb_v_counts(pp: int, micro_batches: int, rank: int, shares: Costs) -> tuple[np.ndarray, np.ndarray]:
    order = zb_v_orders(pp, micro_batches, shares)[rank]
    chunk = {v: i for i, v in enumerate(placement_of(ZB_V, pp).stages_of(rank))}
    forwarded = np.zeros((len(order) + 1, 2), dtype=np.int64)
    deferring = np.zeros_like(forwarded)
    for t, (kind, v, _) in enumerate(order, start=1):
        forwarded[t], deferring[t] = forwarded[t - 1], deferring[t - 1]
        c = chunk[v]
        if kind == FORWARD:
            forwarded[t, c] += 1
        elif kind == INPUT_GRAD:
            forwarded[t, c] -= 1
            deferring[t, c] += 1
        elif kind == WEIGHT_GRAD:
            deferring[t, c] -= 1
    return forwarded, deferring
