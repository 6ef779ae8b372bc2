"""Deferred weight gradients: a linear layer's backward split in two passes, B now and W later.

A linear layer y = x Wᵀ + b has three backward products (model/recompute.py):

    B   ∂L/∂x = g W                      on the critical path: the previous layer needs it
    W   ∂L/∂W = gᵀ x,  ∂L/∂b = Σ_rows g   needed only by the optimizer step

A zero-bubble pipeline schedule (parallel/zero_bubble.py) runs B as soon as the next stage's gradient
arrives and W later, in what would otherwise be the bubble. A layer built with a `WeightGradStore`
(model.modes.LayerModes.weight_grads) does exactly that: its backward computes ∂L/∂x (and any
tensor-parallel reduction of it, which stays on B's path) and hands the store a closure over g and x
that computes the weight-gradient products later, once. Nothing is recomputed: W runs the very products
that backward would have run, on the tensors backward would have used.

The store groups the closures by backward pass (`seal` after each micro batch's B) and `run_oldest`
runs one micro batch's W, first in, first out, so gradients accumulate in the order a plain backward
accumulates them. The gradients enter `.grad` through autograd's own accumulation
(torch.autograd.backward on the parameters themselves), so the gradient hooks an optimizer registers
(DeepSpeed's ZeRO) fire as they would for a plain backward. A layer built without a store (None) runs
its whole backward at once: nothing changes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

# one deferred layer: its parameters (weight, bias or None), the function giving their gradients and its arguments
Deferred = tuple[tuple[torch.Tensor, torch.Tensor | None], Callable[..., tuple[torch.Tensor, torch.Tensor | None]], tuple]


class WeightGradStore:
    """The deferred weight-gradient work of one pipeline stage, a list per backward pass, oldest first."""

    def __init__(self):
        self._open: list[Deferred] = []  # the backward pass under way
        self._sealed: deque[list[Deferred]] = deque()
        self._compiling = False  # `compile` called: each function runs compiled
        self._compiled: dict[Callable, Callable] = {}  # function → its compiled form

    def defer(self, weight: torch.Tensor, bias: torch.Tensor | None, grads: Callable, *args) -> None:
        """Called by a layer's backward: grads(*args) → (∂L/∂W, ∂L/∂b or None), to be run by `run_oldest`. Tensor
        arguments are kept detached: one unpacked in a backward carries the graph behind it (grad_fn) down to the
        stage's input, an autograd leaf its AccumulateGrad node holds, which W has no use for and would keep alive
        until it runs."""
        kept = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        self._open.append(((weight, bias), grads, kept))

    def compile(self) -> None:
        """Run the deferred products compiled from now on (model.compile): each function handed to `defer`
        through torch.compile, once per function, so a W pass is a compiled piece of its own, apart from
        the compiled blocks whose backward deferred it."""
        self._compiling = True

    def seal(self) -> None:
        """Close the backward pass that just ran: its deferred work becomes one W pass."""
        self._sealed.append(self._open)
        self._open = []

    @property
    def pending(self) -> int:
        """W passes sealed and not yet run."""
        return len(self._sealed)

    def oldest_parameters(self) -> list[torch.Tensor]:
        """The parameters the oldest sealed W pass will accumulate into."""
        if not self._sealed:
            raise RuntimeError("no deferred weight gradients to run: every W pass needs its B pass first")
        return [p for (weight, bias), _, _ in self._sealed[0] for p in (weight, bias) if p is not None]

    def run_oldest(self, after_each: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Run the oldest sealed W pass: every deferred product of that backward, each once, layer by layer,
        accumulated into the layer's parameters' .grad by autograd (dtype cast as autograd casts a Function's
        gradients), then after_each(those parameters) if given, before the next layer's products run, so no
        more than one layer's fresh gradients are alive at once."""
        if not self._sealed:
            raise RuntimeError("no deferred weight gradients to run: every W pass needs its B pass first")
        for (weight, bias), grads, args in self._sealed.popleft():
            grad_w, grad_b = self._runner(grads)(*args)  # (n, k), (n,) or None
            params, grads = [weight], [grad_w.to(weight.dtype)]
            if bias is not None:
                params.append(bias)
                grads.append(grad_b.to(bias.dtype))
            torch.autograd.backward(params, grads)
            del grads, grad_w, grad_b
            if after_each is not None:
                after_each(params)

    def _runner(self, grads: Callable) -> Callable:
        """`grads` itself, or once `compile` was called its compiled form (made on first use)."""
        if not self._compiling:
            return grads
        if grads not in self._compiled:
            self._compiled[grads] = torch.compile(grads)
        return self._compiled[grads]

    def check_drained(self) -> None:
        """Raise unless every deferred product has run (before an optimizer step reads the gradients)."""
        if self._open or self._sealed:
            raise RuntimeError(f"{len(self._sealed)} W pass(es) and {len(self._open)} unsealed layer(s) of deferred "
                               f"weight gradients not run before the optimizer step")
