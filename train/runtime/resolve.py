"""What this process computes on, resolved once: the device and the precision on it.

`resolve_runtime` is the one place train.device and train.precision are resolved (auto: a GPU when one
is visible, bf16 on it and fp32 on the CPU) and fp8 is checked against the device; the run
specification carries the `Runtime` it returns (train/run/spec.py), and the commands that run a
trained model make theirs the same way. Nothing below resolves either setting again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.modes import Float8
from train.config.sections.train import TrainConfig
from train.runtime.device import resolve_device
from train.runtime.precision import check_fp8, fp8_mode, resolve_precision


@dataclass(frozen=True)
class Runtime:
    """The device and the resolved train.precision (fp32, autocast, bf16 or fp8; never auto), with
    train.fp8_recipe for fp8's block linears."""

    device: torch.device
    precision: str
    fp8_recipe: str = "tensorwise"

    @property
    def autocast(self) -> bool:
        """Forward and backward under torch's bf16 autocast (train.precision=autocast)."""
        return self.precision == "autocast"

    @property
    def bf16_products(self) -> bool:
        """The matrix products in bf16, as every precision but fp32 computes them (the end-of-run sample
        and evaluation run under bf16 autocast then)."""
        return self.precision != "fp32"

    @property
    def fp8(self) -> Float8 | None:
        """How the blocks' linears compute in float8 under fp8 (parallel.build.BuildOptions.fp8), else None."""
        return fp8_mode(self.precision, self.fp8_recipe, self.device)


def resolve_runtime(train: TrainConfig) -> Runtime:
    """train.device and train.precision resolved on this machine; fp8 needs a device that runs float8
    products and torchao. ValueError, one line naming the key, when either cannot be."""
    device = resolve_device(train.device)
    check_fp8(train, device)
    return Runtime(device, resolve_precision(train.precision, device), train.fp8_recipe)
