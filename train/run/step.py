"""One training step, whatever the engine: the loop calls `step(window)` and never asks whether
the model is pipelined.

A step is one optimizer update on this rank's share of one global batch, windows (n, T + 1) cut
into micro batches of `micro_batch_size` (inputs = window[:, :-1], targets = window[:, 1:]):

  DeepSpeedEngine (pp = 1)   forward, backward and engine.step() per micro batch; DeepSpeed
                             accumulates and updates at the last one
  PipelineEngine  (pp > 1)   train_batch over all micro batches (1F1B schedule, one update); each
                             micro batch enters as ((inputs, targets), None): the targets travel
                             with the activations to the last stage, whose forward returns the
                             loss (parallel/pipeline.py), so DeepSpeed gets no labels of its own

The number of micro batches may change from step to step (a batch-size ramp, train/run/batch_ramp.py):
the engine's gradient accumulation follows it (`set_train_batch_size`: DeepSpeed divides each micro
batch's loss by its accumulation steps, and the pipeline runs that many micro batches), and the
last micro batch is marked as the accumulation boundary, since DeepSpeed's own boundary counts
micro batches since the start of the run.

Both return the mean loss over the micro batches, on the device (no host sync), the pre-clip
global gradient norm (as the engine holds it: read from the device only when asked, at logging),
the learning rate the update used and whether the update was skipped. A step reads nothing from the
device, whatever the number of micro batches (tests/train/run/test_step_syncs.py counts): our optimizers
decide the skip on the device (train/run/optimizer.py), and the step reports it as a device flag, which
the loop reads when it logs or one step later (train/guard/safeguards.py); behind DeepSpeed's ZeRO
optimizers (ZeRO 2 and 3, fp32 at ZeRO 1) DeepSpeed decides it on the host and counts it in
`engine.skipped_steps`. Evaluation reads its losses once per batch. The model's loss comes flagged
(model.layers.flag_non_finite), so a non-finite loss on any rank makes every rank's optimizer skip the
update (train/guard/nonfinite.py).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch


@dataclass
class StepResult:
    loss: torch.Tensor  # mean loss over this rank's micro batches: a float32 scalar on the device
    reported_norm: torch.Tensor | float | None  # the engine's pre-clip gradient norm, as it holds it (None: none)
    lr: float  # the learning rate of this update
    # the optimizer skipped the update (a non-finite loss or gradient on some rank): a 0-d float tensor on the
    # device (1.0: skipped) when our optimizer decided it there, a bool when DeepSpeed decided it on the host
    skipped: torch.Tensor | bool = False

    @functools.cached_property
    def grad_norm(self) -> float | None:
        """Global L2 norm of the gradient before clipping, as a number: read from the device once, when asked."""
        return None if self.reported_norm is None else float(self.reported_norm)


class TrainStep:
    """Runs training and evaluation steps on a DeepSpeed engine (pipelined or not)."""

    def __init__(self, engine, micro_batch_size: int, device: torch.device, autocast: bool = False,
                 skips_on_device=None, weight_casts=None):
        """skips_on_device: the optimizer (train/run/optimizer.py: ClippingAdamW) whose `skipped` flag holds each
        step's skip, decided on the device; None when DeepSpeed decides it on the host. weight_casts: the float8
        layers' model.float8_weights.WeightCasts (train.precision=fp8), each step run inside its `step()`."""
        from deepspeed.runtime.pipe.engine import PipelineEngine

        self.engine, self.micro_batch_size, self.device = engine, micro_batch_size, device
        self.autocast = autocast  # train.precision=autocast: evaluation under bf16 autocast too
        self.skips_on_device = skips_on_device
        self.weight_casts = weight_casts
        self.pipelined = isinstance(engine, PipelineEngine)

    def __call__(self, windows: torch.Tensor) -> StepResult:
        """One optimizer step on this rank's windows (n, T + 1) of the global batch, marked as a
        `train_step` range for torch.profiler (bench/profile.py)."""
        casts = self.weight_casts.step() if self.weight_casts is not None else contextlib.nullcontext()
        with torch.profiler.record_function("train_step"), casts:  # the weights change only at the step's end
            return self._step(windows)

    def _step(self, windows: torch.Tensor) -> StepResult:
        engine = self.engine
        micro_batches = micro_batch_split(to_device(windows, self.device), self.micro_batch_size)
        self._accumulate(len(micro_batches))
        engine.train()
        lr = engine.get_lr()[0]  # the rate this step uses (train/run/optimizer.py: TokenLR)
        skipped_before = engine.skipped_steps
        if self.pipelined:
            loss = engine.train_batch(data_iter=pipeline_inputs(micro_batches))  # 1F1B over all micro batches
        else:
            losses = []
            for k, (inputs, targets) in enumerate(micro_batches):
                engine.set_gradient_accumulation_boundary(k == len(micro_batches) - 1)
                micro_loss = engine(inputs, targets)
                engine.backward(micro_loss)
                engine.step()
                losses.append(micro_loss.detach())
            loss = losses[0].float() if len(losses) == 1 else torch.stack(losses).float().mean()
        if self.skips_on_device is not None:
            skipped = self.skips_on_device.skipped  # 0-d, on the device
        else:
            skipped = engine.skipped_steps > skipped_before
        return StepResult(loss, engine.get_global_grad_norm(), lr, skipped)

    def _accumulate(self, micro_batches: int) -> None:
        """Make the engine accumulate `micro_batches` micro batches per update (the global batch is
        micro_batches × micro_batch_size × dp sequences)."""
        engine = self.engine
        if engine.gradient_accumulation_steps() != micro_batches:
            engine.set_train_batch_size(micro_batches * self.micro_batch_size * engine.dp_world_size)

    @torch.no_grad()
    def evaluate(self, val_batches: list[torch.Tensor]) -> list[float]:
        """This rank's mean loss of each micro batch (pp = 1) or each batch (pp > 1) of held-out windows."""
        engine, device = self.engine, self.device
        engine.eval()
        losses = []
        for windows in val_batches:
            micro_batches = micro_batch_split(to_device(windows, device), self.micro_batch_size)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast):
                if self.pipelined:
                    n = len(micro_batches)
                    losses.append(float(engine.eval_batch(data_iter=pipeline_inputs(micro_batches), num_micro_batches=n)))
                else:  # read once per batch: one host sync, not one per micro batch
                    losses += torch.stack([engine(inputs, targets).float() for inputs, targets in micro_batches]).tolist()
        engine.train()
        return losses


def to_device(windows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """windows on `device`. To a GPU through pinned (page-locked) memory, copied without blocking the host:
    the copy is queued on the current stream ahead of the forward that reads it, and the host goes on
    queuing work instead of waiting for a copy from pageable memory. Windows already on a GPU (a
    benchmark's, say) are moved as they are: only host memory can be pinned."""
    if device.type != "cuda" or windows.device.type != "cpu":
        return windows.to(device)
    return windows.pin_memory().to(device, non_blocking=True)


def micro_batch_split(windows: torch.Tensor, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) pairs of `size` sequences from windows (n, T+1): inputs (size, T), targets shifted by one."""
    return [(m[:, :-1], m[:, 1:]) for m in windows.split(size)]


def pipeline_inputs(micro_batches: list[tuple[torch.Tensor, torch.Tensor]]):
    """The pipeline engine's batches: ((inputs, targets), None) each; stage 0 loads the pair, whose
    targets reach the last stage with the activations, and no stage loads labels (parallel/pipeline.py)."""
    return iter([(pair, None) for pair in micro_batches])
