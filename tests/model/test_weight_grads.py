"""Deferred weight gradients (model/weight_grads.py): B now, W later, every product once.

The reference is float64 autograd of the same linear: the backward with a store gives ∂L/∂x and leaves
the weight and bias without gradients; each W pass, first in first out, adds one micro batch's
∂L/∂W and ∂L/∂b, so after both passes the gradients are the float64 sums over the micro batches.
"""

from __future__ import annotations

import pytest
import torch

from model.recompute import MATMULS, Grads, Linear, Recompute, linear
from model.weight_grads import WeightGradStore


def _reference(layer: Linear, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """float64 autograd of L = Σ_micro batches Σ (x Wᵀ + b)²: (∂L/∂x per micro batch, ∂L/∂W, ∂L/∂b)."""
    w = layer.weight.detach().double().requires_grad_()
    b = layer.bias.detach().double().requires_grad_()
    input_grads = []
    for x in inputs:
        x64 = x.detach().double().requires_grad_()
        torch.nn.functional.linear(x64, w, b).square().sum().backward()
        input_grads.append(x64.grad)
    return input_grads, w.grad, b.grad


def test_b_gives_the_input_gradient_and_w_adds_each_micro_batch_in_order():
    torch.manual_seed(0)
    store = WeightGradStore()
    layer = Linear(8, 6, weight_grads=store)
    inputs = [torch.randn(2, 5, 8) for _ in range(2)]
    input_grads, weight_grad, bias_grad = _reference(layer, inputs)
    for x, expected in zip(inputs, input_grads):
        x = x.clone().requires_grad_()
        layer(x).square().sum().backward()
        store.seal()
        torch.testing.assert_close(x.grad.double(), expected, rtol=1e-5, atol=1e-5)
    assert layer.weight.grad is None and layer.bias.grad is None and store.pending == 2
    store.run_oldest()
    first_w = layer.weight.grad.clone()
    x0 = inputs[0].double()
    g0 = 2 * torch.nn.functional.linear(x0, layer.weight.double(), layer.bias.double())  # ∂L/∂y of micro batch 0
    torch.testing.assert_close(first_w.double(), g0.flatten(0, 1).t() @ x0.flatten(0, 1), rtol=1e-5, atol=1e-5)
    store.run_oldest()
    torch.testing.assert_close(layer.weight.grad.double(), weight_grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.bias.grad.double(), bias_grad, rtol=1e-5, atol=1e-5)
    store.check_drained()


class _Counting:
    """The plain products, counting each kind of product the backward runs."""

    def __init__(self):
        self.counts = {"input": 0, "weight": 0}

    def forward(self, x, w, bias):
        return MATMULS.forward(x, w, bias)

    def backward(self, g, kept):
        counts = self.counts

        class Counted(Grads):
            def input_grad(self, w):
                counts["input"] += 1
                return super().input_grad(w)

            def weight_grad(self, x):
                counts["weight"] += 1
                return super().weight_grad(x)

        return Counted(g)


def test_every_product_runs_once_and_the_recomputed_input_is_recomputed_once():
    store, matmuls, recomputed = WeightGradStore(), _Counting(), []
    norm = torch.nn.LayerNorm(8)
    weight, bias = torch.nn.Parameter(torch.randn(6, 8)), torch.nn.Parameter(torch.randn(6))

    def norm_again(h):
        recomputed.append(1)
        return norm(h)

    h = torch.randn(3, 8, requires_grad=True)
    y = linear(norm(h), weight, bias, recompute=Recompute(norm_again, h), matmuls=matmuls, weight_grads=store)
    y.sum().backward()
    store.seal()
    assert matmuls.counts == {"input": 1, "weight": 0} and len(recomputed) == 1
    store.run_oldest()
    assert matmuls.counts == {"input": 1, "weight": 1} and len(recomputed) == 1


def test_without_a_store_nothing_is_deferred():
    layer = Linear(4, 3)
    layer(torch.randn(2, 4)).sum().backward()
    assert layer.weight.grad is not None and layer.bias.grad is not None


def test_a_w_pass_without_its_b_and_an_undrained_store_are_refused():
    store = WeightGradStore()
    with pytest.raises(RuntimeError, match="every W pass needs its B pass first"):
        store.run_oldest()
    layer = Linear(4, 3, weight_grads=store)
    layer(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="not run before the optimizer step"):
        store.check_drained()
    store.seal()
    with pytest.raises(RuntimeError, match="1 W pass"):
        store.check_drained()
