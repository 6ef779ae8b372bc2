"""The float8 casts of the weights, kept through one training step (train.precision=fp8).

A float8 layer multiplies Ŵ = sat(W · s_W) in two layouts (the forward's Wᵀ and the input gradient's W, each
column-major as torch._scaled_mm takes its second operand), with s_W = f_max / amax(W). The weights change only
when the optimizer steps, so within a step every micro batch would cast the same W to the same Ŵ: the amax (a
pass over W, and under tensor parallelism an all-reduce), the scale, and two casts. `WeightCasts` keeps them
from a weight's first use in the step to the step's end: the trainer runs each step inside `step()`, the
layers look their weight up (`kept`) and keep what they made (`keep`). The ring layers do
(parallel/ring_operands.py, parallel.tp_comm_overlap); the other float8 layers (model/float8.py) still cast
every micro batch. Outside a step (evaluation, generation,
benchmarks) nothing is kept and every call casts again. Kept: one byte an element of each float8 layout, per
float8 weight of the rank, until the step ends; the values are those a fresh cast gives (the cast is
deterministic), so keeping changes no number.
"""

from __future__ import annotations

import contextlib

import torch


class WeightCasts:
    """Float8 weight operands kept for the training step that is running (module docstring)."""

    def __init__(self):
        self._kept: dict[int, dict] | None = None  # by id(weight), while a step runs

    @contextlib.contextmanager
    def step(self):
        """The span in which the weights do not change: a step's micro batches (the optimizer's update at its
        end casts nothing). What was kept is let go when it ends, also on an error."""
        self._kept = {}
        try:
            yield
        finally:
            self._kept = None

    def __len__(self) -> int:
        """Weights whose casts are kept now (0 outside a step)."""
        return 0 if self._kept is None else len(self._kept)

    def kept(self, weight: torch.Tensor) -> dict | None:
        """What a layer kept of `weight` in this step (a dict it filled), or None."""
        return None if self._kept is None else self._kept.get(id(weight))

    def keep(self, weight: torch.Tensor, operands: dict) -> dict:
        """Keep `operands` (a dict the layer may fill further) for `weight` until the step ends; a no-op outside
        a step. Returns `operands`."""
        if self._kept is not None:
            self._kept[id(weight)] = operands
        return operands
