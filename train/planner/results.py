"""What the planner predicts: a `Plan` for one layout, with a `RankPlan` for each pipeline rank it shows
(train/planner/estimate.py builds them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from model import GPTConfig
from train.planner.activations import ActivationBytes
from train.planner.counts import StateBytes, count_full_parameters
from train.planner.hardware import Hardware
from train.planner.layout import Implementation, Layout
from train.planner.pipeline_time import Passes, PipelineTime

GIB = 2**30


@dataclass
class RankPlan:
    """One pipeline rank (every tp and dp rank of a pipeline rank predicts the same). Under the interleaved
    schedule and zb-v it holds several chunks (`chunks`, its virtual stages), and its counts are of chunk
    micro batches."""

    stage: int  # its pipeline rank
    parameters: int
    state: StateBytes
    activations: ActivationBytes
    in_flight: int  # (chunk) micro batches whose activations the rank holds at its peak
    deferred: int  # zb-h1's or zb-v's W passes whose inputs and output gradients it holds then
    deferred_bytes: int  # what one W pass of a micro batch through all its chunks holds (0 without them)
    # at the rank's backward peak: the saved activations, their weight copies and the deferred W passes' inputs
    # and output gradients, in bytes (the instant the rank's order holds the most; the memory's `held`)
    held: tuple[int, int, int]
    memory: dict  # kind → bytes at this rank's peak
    peak_bytes: int
    hardware_flops: float  # per step, this rank
    transfers: list
    time: dict  # per micro batch: compute_s, tp_s, pp_s and its passes forward_s, input_grad_s,
    #             weight_grad_s; per step: dp_s, optimizer_s
    chunks: tuple[int, ...] = ()  # the virtual stages it holds
    chunk_seconds: tuple[float, ...] = ()  # one micro batch through each of them, compute only

    @property
    def passes(self) -> Passes:
        """One micro batch on this rank by pass, its communication included."""
        return Passes(*(self.time[k] for k in ("forward_s", "input_grad_s", "weight_grad_s")))

    def to_json(self) -> dict:
        comm = {}
        for t in self.transfers:
            comm.setdefault(t.group, {}).setdefault(t.op, 0)
            comm[t.group][t.op] += t.total
        return {
            "stage": self.stage,
            "virtual_stages": list(self.chunks),
            "virtual_stage_seconds": list(self.chunk_seconds),
            "parameters": self.parameters,
            "bytes": {k: int(v) for k, v in self.memory.items()},
            "peak_memory_gib": self.peak_bytes / GIB,
            "activations_per_micro_batch": self.activations.saved,
            "micro_batches_in_flight": self.in_flight,
            "deferred_weight_grad_passes_held": self.deferred,
            "deferred_weight_grad_bytes_per_micro_batch": self.deferred_bytes,
            "hardware_flops_per_step": self.hardware_flops,
            "communication_bytes_per_step": comm,
            "time_s": self.time,
        }


@dataclass
class Plan:
    """The prediction for one layout (Plan.to_json() is what `plan.format=json` prints)."""

    model: GPTConfig
    layout: Layout
    hardware: Hardware
    implementation: Implementation
    ranks: list[RankPlan]
    pipeline: PipelineTime
    step_time_s: float
    model_flops_per_step: float
    hardware_flops_per_step: float
    reserved_gib: float = 0.0
    tokens: float = 300e9
    gpus_per_node: int = 8
    notes: list[str] = field(default_factory=list)
    stage_seconds: tuple[float, ...] = ()  # one micro batch through each virtual stage, compute only, in order

    @property
    def parameters(self) -> int:
        """The full model's parameters."""
        return count_full_parameters(self.model)

    @property
    def tokens_per_step(self) -> int:
        return self.layout.global_batch * self.model.seq_len

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def peak_memory_gib(self) -> float:
        return max(r.peak_bytes for r in self.ranks) / GIB

    @property
    def fits(self) -> bool:
        return self.peak_memory_gib + self.reserved_gib <= self.hardware.memory_gib

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.model_flops_per_step / self.step_time_s / self.layout.gpus / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        return self.hardware_flops_per_step / self.step_time_s / self.layout.gpus / 1e12

    @property
    def predicted_mfu(self) -> float:
        return self.model_tflops_per_gpu / self.hardware.peak_tflops

    @property
    def days(self) -> float:
        return self.tokens / self.tokens_per_s / 86400

    @property
    def bubble(self) -> float:
        """The pipeline bubble's share of the pipeline's time (PipelineTime.bubble)."""
        return self.pipeline.bubble

    def to_json(self) -> dict:
        return {
            "model": self.model.name, "parameters": self.parameters, "layout": dataclasses.asdict(self.layout),
            "gpus": self.layout.gpus,
            "hardware": self.hardware.as_dict(), "fits": self.fits, "peak_memory_gib": self.peak_memory_gib,
            "reserved_gib": self.reserved_gib, "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "model_flops_per_step": self.model_flops_per_step, "hardware_flops_per_step": self.hardware_flops_per_step,
            "model_tflops_per_gpu": self.model_tflops_per_gpu, "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "mfu": self.predicted_mfu, "bubble": self.bubble, "pipeline_s": self.pipeline.seconds,
            "pipeline_stage": self.pipeline.slowest.stage, "pipeline_passes_s": dataclasses.asdict(self.pipeline.passes),
            "tokens": self.tokens, "days": self.days,
            "ranks": [r.to_json() for r in self.ranks], "notes": self.notes,
            "virtual_stage_seconds": list(self.stage_seconds),
        }
