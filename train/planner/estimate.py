"""The planner's model of one training step: memory per rank, FLOPs, communication and time.

Counted quantities (parameters, state bytes, activations, communication) come from train/planner/counts.py,
activations.py and comm.py; this module adds the time model and assembles a `Plan`.

Step time, per rank of pipeline stage s with m micro batches (docs/planner.md, "What is counted, and how
the step time is modelled"):

  t_mb(s)  = GEMMs + attention + memory-bound traffic + tensor-parallel collectives + pipeline sends
             (one micro batch, forward and backward; nothing overlaps on a rank's critical path)
  GEMM     each matmul at max(FLOPs / (peak·gemm_efficiency), bytes / achieved HBM bandwidth); in
           fp8 (`Implementation.fp8`) the blocks' linears the fp8 rule picks (train/planner/fp8_rule.py,
           `Implementation.fp8_linears`) at twice that rate (the float8 tensor cores' dense peak is
           twice bf16's on Ada and Hopper) with 1-byte inputs and bf16 outputs, plus their casts'
           traffic (fp8_cast_bytes) and the amax all-reduces' latency under tp
  attention the fused kernel's FLOPs (visible keys only) at peak·attention_efficiency
  traffic  LayerNorm, residual adds, GELU, casts, the loss, gradient accumulation, at HBM bandwidth
  passes   t_mb = t_F + t_B + t_W (`Passes`, parallel/zero_bubble.py): W is the blocks' deferrable
           work, one weight-gradient product gᵀ·x per block linear (the model times a linear's three
           products alike: the same FLOPs, matrices of the same three sizes) and the column layers'
           bias sums (read g); under DeepSpeed's BF16_Optimizer the addition of those parameters' bf16
           gradients to their fp32 ones (BF16_OPTIMIZER_UPDATE_BYTES), which ZB-H1's W does itself.
           F is the forward: one product per linear, the forward traffic, attention's forward, the
           head's forward (with the fused loss all three unembedding products and the loss, which
           it runs in the forward), the forward's collectives and send. B is the rest: the
           input-gradient products, attention's backward, the backward traffic, recomputation, the
           other weights' per-micro-batch traffic (under 1F1B all of it), the backward's collectives
           and send
  pipeline every stage timed as the slowest one (largest t_mb), by parallel.pipeline_schedule:
             1f1b   (m + pp − 1)·t_mb                    bubble (pp − 1)/(m + pp − 1) of it
             zb-h1  m·t_mb + (pp − 1)·(t_F + t_B − t_W)  when m ≥ pp and t_W ≤ min(t_F, t_B); the
                    step of the order ZeroBubbleEngine runs, in closed form for any m and costs
                    (`pipeline_seconds`)
  step     = pipeline + the data-parallel collectives, tied-embedding all-reduce and optimizer (not overlapped)

Activation memory at a stage's peak: under 1F1B, min(pp − s, m) micro batches' saved activations;
under ZB-H1 also the deferred W passes, each holding every block linear's input x and output
gradient g (activations.deferred_weight_grad_bytes), at the larger of two moments: just after a
forward, i = min(pp − s, m) micro batches and min(s, m − i) W passes, and just after a B, i − 1 and
min(s + 1, m − i + 1) (`held_at_peak`: exact for the engine's order at every pp and m). ZB-H1 sends
the same messages as 1F1B: its communication is 1F1B's.

Collectives run at the achieved link bandwidth (NVLink inside a node, the network between nodes)
plus a fixed latency each. Only what the code overlaps is hidden:
  - with `Implementation.overlap_tp` (parallel.overlap_communication), the column layers' backward
    input-gradient all-reduce runs while the same layer's weight-gradient GEMM computes: each is
    exposed by max(0, collective − that GEMM). Under sequence parallelism the code does not overlap
    (the reduce-scatter of those gradients runs after the layer's backward) and neither does the plan;
    under ZB-H1 that GEMM is deferred to W and the all-reduce runs in B with nothing beside it
    (parallel/tensor.py): exposed whole;
  - with `Implementation.overlap_dp` (DeepSpeed's zero_optimization.overlap_comm; its ZeRO optimizer
    at ZeRO 1 and 2, not bf16's BF16_Optimizer, which reduces after the backward; pp = 1), the gradient
    reduction runs in buckets during the backward that produces the gradients:
    ZeRO 2 reduces each micro batch during its own backward, ZeRO 1 only at the last micro batch;
    exposed is max(0, reduction − one micro batch's backward), the backward taken as 2/3 of the micro
    batch's compute (its GEMM FLOPs are twice the forward's; recomputation only lengthens it). Under
    DeepSpeed's pipeline engine the reduction waits for the end of the last backward
    (PipeEngine._exec_reduce_grads is the only gradient-accumulation boundary), so nothing hides;
Nothing else overlaps: not the other tensor-parallel collectives (the next matmul needs their
result), not the pipeline's (DeepSpeed's 1F1B sends block; ZB-H1's are asynchronous, but the plan
counts them on the critical path all the same, the conservative choice: at GPT-3 175B's layout they
are under 0.5% of the step), not ZeRO 1's all-gather of the updated parameters, and not ZeRO-3's parameter
gathers (its prefetching hides little: Narayanan et al.'s ZeRO-3 runs match the model only without
overlap).
A micro batch also takes at least the host time that launching its kernels costs (when that bounds
it, F, B and W each take their share of it).

The whole model on one GPU in bf16, eager (`launch_priced`: tp = pp = dp = 1, nothing offloaded), is priced
launch by launch instead, as the step bill prices the real step (train/planner/one_gpu.py,
train/planner/kernel_costs.py): the products by shape, every memory-bound kernel, the launches the host
issues; F, B and W keep their shares of the FLOP-and-bytes model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from model import GPTConfig, flops_per_token
from model.modes import BLOCK_LINEARS
from train.config.sections.parallel import ONE_F_ONE_B, ZB_H1
from train.config.sections.train import FP8_ALL
from train.planner import comm as plan_comm
from train.planner.activations import (
    ActivationBytes,
    StageShape,
    checkpointed_blocks,
    deferred_weight_grad_bytes,
    micro_batch_activations,
    unembedding_rows,
)
from train.planner.counts import (
    FP32,
    REDUCE_BUCKET_SIZE,
    StateBytes,
    block_elements,
    bucket_elements,
    count_full_parameters,
    rank_parameters,
    stage_blocks,
    state_bytes,
)
from train.planner.fp8_rule import COLUMN_PARALLEL, linears_at
from train.planner.hardware import Hardware
from train.planner.one_gpu import one_gpu_step

GIB = 2**30
COLLECTIVE_LATENCY_S = 15e-6  # per collective call (NCCL launch and ring start-up)
OPTIMIZER_BYTES = 64  # memory traffic per updated element: AdamW (p, g, m, v read, p, m, v written,
#                       foreach temporaries) plus the gradient-norm and clipping passes
SELECTIVE_KERNELS = 3  # kernels selective recomputation adds per block: two LayerNorms and a GELU
LOSS_BYTES = 32  # memory traffic per logit: float copy, log-softmax, its backward, cast back
# Memory traffic per parameter element and micro batch of DeepSpeed's BF16_Optimizer (ZeRO ≤ 1 with bf16
# weights) adding the micro batch's bf16 gradient to its fp32 one (update_hp_grads: the bf16 gradient read
# 2 and cast to an fp32 temporary 4, then the fp32 gradient read 4, the temporary read 4, the sum written 4),
# under either schedule; beside the clearing and accumulation of the bf16 gradient (_per_weight_bytes)
BF16_OPTIMIZER_UPDATE_BYTES = 18


@dataclass(frozen=True)
class Layout:
    """A parallel layout and batch geometry (sequences)."""

    tp: int
    pp: int
    dp: int
    global_batch: int
    micro_batch: int = 1
    zero_stage: int = 0
    offload_optimizer: bool = False
    sequence_parallel: bool = False
    checkpoint_every: int = 0
    selective_recompute: bool = False  # parallel.activation_checkpointing=selective
    schedule: str = ONE_F_ONE_B  # parallel.pipeline_schedule: 1f1b or zb-h1 (only with pp > 1)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def zero_bubble(self) -> bool:
        """The pipeline runs ZB-H1: pp > 1 and parallel.pipeline_schedule=zb-h1."""
        return self.pp > 1 and self.schedule == ZB_H1

    @property
    def micro_batches(self) -> int:
        """Micro batches per step on each data-parallel replica."""
        return self.global_batch // (self.micro_batch * self.dp)

    def describe(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}", f"zero={self.zero_stage}", f"micro={self.micro_batch}"]
        if self.selective_recompute:
            parts.append("ckpt=selective")
        else:
            parts.append(f"ckpt={self.checkpoint_every}" if self.checkpoint_every else "ckpt=off")
        if self.sequence_parallel:
            parts.append("sp")
        if self.offload_optimizer:
            parts.append("offload")
        if self.schedule != ONE_F_ONE_B:
            parts.append(self.schedule)
        return " ".join(parts)


@dataclass(frozen=True)
class Implementation:
    """How the trainer runs the math. The default: gpt3d with train.precision=autocast, fp32
    parameters with bf16 autocast (each micro batch casts the weights), its fused attention, nothing
    overlapped, the fused loss (`for_precision` gives the other precisions). Published
    Megatron-style runs: bf16 parameters (fp32_weights=False, autocast=True: bf16 matmuls, no
    casts) and the plain vocab-parallel loss (fused_loss=False)."""

    fp32_weights: bool = True
    autocast: bool = True  # bf16 matmuls (with fp32_weights=False: the weights themselves are bf16)
    overlap_tp: bool = False  # the column layers' input-gradient collective runs during their weight-gradient GEMM
    overlap_dp: bool = False  # ZeRO 1/2 reduce gradients in buckets during the backward (overlap_comm)
    fused_loss: bool = True  # train.fused_loss: the loss unembeds chunk by chunk, no (n, Vp/p) logits kept
    # measured on this project's H100 (README, "How the step time is modelled"):
    attention_efficiency: float = 0.21  # the fused attention's forward+backward, 212 of 989 TFLOP/s
    unaligned_gemm_efficiency: float = 0.1  # a GEMM with a dimension not a multiple of 8 (vocab 50257)
    kernels_per_block: int = 100  # kernels one block launches per micro batch, forward and backward
    host_seconds_per_kernel: float = 30e-6  # Python and launch time per kernel: the GPU cannot run ahead
    grad_reduce_bytes: int | None = None  # None: gpt3d's (bf16 weights: bf16; fp32 weights: fp32, but
    #                                       DeepSpeed reduces nn.Linear gradients in bf16 under autocast
    #                                       at ZeRO ≥ 1); else this size for all
    fp8: str | None = None  # the float8 recipe of the blocks' linears (train.precision=fp8), with bf16 weights
    # which block linears compute in float8: train.fp8_linears (auto: by the fp8 rule at each layout, fp8_rule.py;
    # all), or the names a run resolved
    fp8_linears: object = FP8_ALL
    compiled: bool = False  # model.compile: the float8 casts fuse into the compiled blocks' kernels

    @property
    def bf16_weights(self) -> bool:
        """bf16 parameters and gradients (fp32 master weights in the optimizer)."""
        return not self.fp32_weights and self.autocast

    @property
    def precision(self) -> str:
        """The train.precision this is: fp32, autocast, bf16 or fp8."""
        if self.fp8 is not None:
            return "fp8"
        return "bf16" if self.bf16_weights else "autocast" if self.autocast else "fp32"


PRECISIONS = ("fp32", "autocast", "bf16", "fp8")
# Bytes of memory traffic per element of x, W and g of a linear layer, per micro batch, for its float8 casts
# (model/float8.py, eager): each cast reads its bf16 operand for the amax (2) unless the amax is known,
# then again to scale it and writes float8 (3); the input grad's W and the weight grad's gᵀ and x are copied
# once more into the layout _scaled_mm takes (read and write a float8 byte, 2). Tensorwise: x 5 + 5,
# W 5 + 5, g 5 + 5 (the weight grad reuses the amaxes); rowwise: every cast has its own amax, 12 each.
FP8_CAST_BYTES = {"tensorwise": 10, "rowwise": 12}
# All-reduces of amaxes per float8 linear and micro batch under tensor parallelism (model/float8.py's table):
# tensorwise, a column layer's W (forward) and g (backward), a row layer's x and W (forward, one call): 2 and 1;
# rowwise, a column layer's input grad and a row layer's forward: 1 each. (Column, row) per recipe.
FP8_AMAX_REDUCTIONS = {"tensorwise": (2, 1), "rowwise": (1, 1)}
# Kernels one block linear adds in float8, forward and backward, eager: amaxes, scales, casts, layout copies,
# the scaled products (aten operations other than views, counted on one linear: 78 tensorwise and 113 rowwise,
# against the plain linear's 6). At 30 µs of host time each they bound a large model's micro batch unless
# model.compile fuses them (Implementation.compiled: none added; their memory traffic is still counted).
FP8_KERNELS_PER_LINEAR = {"tensorwise": 72, "rowwise": 107}


def for_precision(precision: str, overlap_communication: bool = True, fused_loss: bool = True,
                  fp8_recipe: str = "tensorwise", compiled: bool = False, fp8_linears=FP8_ALL) -> Implementation:
    """gpt3d under train.precision (auto resolved by the caller): fp32 everything; autocast (fp32
    weights, bf16 matmuls with per-micro-batch casts); bf16 (bf16 weights and gradients, fp32 master
    weights and moments in the optimizer); fp8 (bf16, and the blocks' linears in float8 by
    `fp8_recipe`, on the linears `fp8_linears` says: train.fp8_linears, or a run's resolved names).
    overlap_communication: parallel.overlap_communication, and DeepSpeed's overlap_comm set from the plan
    (train/planner/zero_buckets.py); fused_loss: train.fused_loss; compiled: model.compile."""
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision={precision!r}: must be one of {['auto', *PRECISIONS]}")
    return Implementation(
        fp32_weights=precision in ("fp32", "autocast"), autocast=precision != "fp32",
        overlap_tp=overlap_communication, overlap_dp=overlap_communication, fused_loss=fused_loss,
        fp8=fp8_recipe if precision == "fp8" else None, compiled=compiled,
        fp8_linears=tuple(fp8_linears) if isinstance(fp8_linears, (list, tuple)) else fp8_linears,
    )


@dataclass(frozen=True)
class Passes:
    """Seconds of one micro batch on a stage in the passes ZB-H1 schedules apart (parallel/zero_bubble.py):
    the forward F, the input gradient B (the whole backward but W) and the weight gradients W."""

    forward: float
    input_grad: float
    weight_grad: float

    @property
    def total(self) -> float:
        return self.forward + self.input_grad + self.weight_grad

    def scaled_to(self, seconds: float) -> "Passes":
        """The same shares of `seconds` (a micro batch bound by its host time)."""
        ratio = seconds / self.total
        return Passes(self.forward * ratio, self.input_grad * ratio, self.weight_grad * ratio)


def pipeline_seconds(schedule: str, stages: int, micro_batches: int, passes: Passes) -> float:
    """Seconds from the first forward to the last pass of m micro batches through p stages that each take
    `passes` (F, B, W) per micro batch, T = F + B + W:

      1f1b          (m + p − 1)·T
      zb-h1, m ≥ p  m·T + (p − 1)·(F + B − min(W, F, B))      (W ≤ min(F, B): Qi et al.'s (p − 1)(F + B − W))
      zb-h1, m < p  max(p·(F + B) + (m − 1)·(max(F, W) + B) + W,  (p − 1)·F + m·T)

    For m < p the first stage waits p·(F + B) for its first B, then each later one F + B after the one before,
    or max(F, W) + B when its W (which stage 0 runs right after each B) is longer than F; the last stage starts
    after (p − 1)·F and then runs all its work, its W passes last. Each form is the step of the order
    ZeroBubbleEngine runs (parallel.zero_bubble.stage_orders with equal costs) as parallel.zero_bubble.timeline
    times it under these costs, exactly (tests/train/planner/test_plan_schedules.py); with p = 1 both schedules
    take m·T."""
    p, m, whole = stages, micro_batches, passes.total
    f, b, w = passes.forward, passes.input_grad, passes.weight_grad
    if schedule == ONE_F_ONE_B or p == 1:
        return (m + p - 1) * whole
    if m >= p:
        return m * whole + (p - 1) * (f + b - min(w, f, b))
    return max(p * (f + b) + (m - 1) * (max(f, w) + b) + w, (p - 1) * f + m * whole)


@dataclass(frozen=True)
class PipelineTime:
    """The pipeline part of a step: m micro batches through the layout's stages under its schedule, every
    stage timed as `slowest`, the stage with the largest F + B + W."""

    micro_batches: int
    slowest: "RankPlan"
    seconds: float  # pipeline_seconds

    @property
    def passes(self) -> Passes:
        return self.slowest.passes

    @property
    def bubble_s(self) -> float:
        """The slowest stage's idle time: the pipeline's seconds less its m micro batches."""
        return self.seconds - self.micro_batches * self.passes.total

    @property
    def bubble(self) -> float:
        """The bubble's share of the pipeline's seconds: 1F1B (pp − 1)/(m + pp − 1), ZB-H1
        (pp − 1)(F + B − W) / [m(F + B + W) + (pp − 1)(F + B − W)] (pipeline_seconds)."""
        return self.bubble_s / self.seconds


@dataclass
class RankPlan:
    """One rank of a pipeline stage (every tp and dp rank of a stage predicts the same)."""

    stage: int
    parameters: int
    state: StateBytes
    activations: ActivationBytes
    in_flight: int  # micro batches whose activations the rank holds at its peak
    deferred: int  # ZB-H1's W passes whose inputs and output gradients it holds then (held_at_peak)
    deferred_bytes: int  # what one such W pass holds (activations.deferred_weight_grad_bytes; 0 under 1F1B)
    memory: dict  # kind → bytes at this rank's peak
    peak_bytes: int
    hardware_flops: float  # per step, this rank
    transfers: list
    time: dict  # per micro batch: compute_s, tp_s, pp_s and its passes forward_s, input_grad_s,
    #             weight_grad_s; per step: dp_s, optimizer_s

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
        }


def model_flops_per_token(model_cfg: GPTConfig) -> float:
    """PaLM's 6N + 12·L·d·T (model/gpt.py), N without the position table."""
    n = sum(p.full_numel for p in rank_parameters(model_cfg, 1, 1, 0) if not p.name.endswith("wpe.weight"))
    return flops_per_token(n, model_cfg.n_layer, model_cfg.d_model, model_cfg.seq_len)


def _visible_keys(model_cfg: GPTConfig, layer: int) -> float:
    """Mean keys a query attends to (causal; GPT-3's banded layers see at most the window)."""
    t, w = model_cfg.seq_len, model_cfg.window_of(layer)
    if w is None or w >= t:
        return (t + 1) / 2
    return w - (w * (w - 1) / 2) / t


def _gemm_time(hw: Hardware, impl: Implementation, n: int, k: int, m: int, elem: int) -> float:
    """(n×k)·(k×m): the slower of its FLOPs and its bytes (inputs read once, output written once).
    A dimension that is no multiple of 8 leaves cuBLAS only its slow unaligned kernels."""
    rate = hw.flops if k % 8 == 0 and m % 8 == 0 else hw.peak_tflops * 1e12 * impl.unaligned_gemm_efficiency
    return max(2 * n * k * m / rate, (n * k + k * m + n * m) * elem / hw.memory_bandwidth)


def _fp8_gemm_time(hw: Hardware, n: int, k: int, m: int) -> float:
    """(n×k)·(k×m) in float8: twice bf16's rate, 1-byte inputs, a bf16 output."""
    return max(2 * n * k * m / (2 * hw.flops), (n * k + k * m + 2 * n * m) / hw.memory_bandwidth)


def _linear_time(hw: Hardware, impl: Implementation, n: int, k: int, m: int, fp8: bool = True) -> float:
    """One block linear's product (n×k)·(k×m): in the compute dtype, or (fp8, under train.precision=fp8) in
    float8 with its share of the casts (a third of the layer's: FP8_CAST_BYTES covers its three products)."""
    if impl.fp8 is None or not fp8:
        return _gemm_time(hw, impl, n, k, m, _matmul_bytes(impl))
    casts = FP8_CAST_BYTES[impl.fp8] * (n * k + k * m + n * m) / 3
    return _fp8_gemm_time(hw, n, k, m) + casts / hw.memory_bandwidth


def _blocks_compute(model_cfg: GPTConfig, layout: Layout, impl: Implementation, hw: Hardware, blocks: list[int],
                    recomputed: int) -> tuple[Passes, float, float]:
    """(seconds by pass, hardware FLOPs, host kernels) of `blocks`' forward + backward of one micro batch
    on a rank, `recomputed` of them inside checkpointed segments: GEMMs, attention, memory-bound traffic
    and selective recomputation (not the weights' casts and gradient accumulation).

    Per block, with G the time of one product of each of its four linears (a linear's three products
    have the same FLOPs and matrices of the same three sizes, so the model times them alike), X its
    forward traffic and A its attention's forward (QKᵀ and PV): F = G + X + A; W = G + the column
    layers' bias sums (read g, a·n·(3d + f)/p bytes); B = G + 2X + 2.5A − the bias sums, plus
    recomputation and the fp8 amax reductions. F + B + W is the block's whole micro batch as before."""
    tp, sigma = layout.tp, layout.tp if layout.sequence_parallel else 1
    d, f, n = model_cfg.d_model, model_cfg.d_ff, layout.micro_batch * model_cfg.seq_len
    bandwidth = hw.memory_bandwidth
    gemms = [(n, d, 3 * d // tp), (n, d // tp, d), (n, d, f // tp), (n, f // tp, d)]  # in BLOCK_LINEARS' order
    in_fp8 = linears_at(model_cfg, layout, impl, hw)  # the block linears in float8 (none without fp8)
    fwd_gemm_t = sum(_linear_time(hw, impl, *g, fp8=name in in_fp8) for name, g in zip(BLOCK_LINEARS, gemms))
    fwd_gemm_f = sum(2 * x * y * z for x, y, z in gemms)
    attn_f = [4 * n * d / tp * _visible_keys(model_cfg, i) for i in blocks]  # QKᵀ and PV
    attn_rate = hw.peak_tflops * 1e12 * impl.attention_efficiency
    block_traffic = _block_traffic_per_token(d, f, tp, sigma, impl) * n
    bias_sums = _matmul_bytes(impl) * n * (3 * d + f) / tp / bandwidth
    forward = len(blocks) * (fwd_gemm_t + block_traffic / bandwidth) + sum(attn_f) / attn_rate
    weight_grad = len(blocks) * (fwd_gemm_t + bias_sums)
    input_grad = len(blocks) * (fwd_gemm_t + 2 * block_traffic / bandwidth - bias_sums)
    input_grad += sum(2.5 * x for x in attn_f) / attn_rate
    attn_recomputed = recomputed * sum(attn_f) / max(len(blocks), 1)
    input_grad += recomputed * (fwd_gemm_t + block_traffic / bandwidth) + attn_recomputed / attn_rate
    kernels = impl.kernels_per_block * (len(blocks) + 0.35 * recomputed)
    if layout.selective_recompute:
        kept = len(blocks) - recomputed
        input_grad += kept * _selective_recompute_per_token(d, f, tp, layout.sequence_parallel, impl) * n / bandwidth
        kernels += SELECTIVE_KERNELS * kept
    if impl.fp8 is not None:
        if not impl.compiled:
            kernels += len(in_fp8) * FP8_KERNELS_PER_LINEAR[impl.fp8] * (len(blocks) + recomputed)
        if tp > 1:
            column, row = FP8_AMAX_REDUCTIONS[impl.fp8]
            reductions = sum(column if name in COLUMN_PARALLEL else row for name in in_fp8)
            input_grad += len(blocks) * reductions * COLLECTIVE_LATENCY_S
    flops = len(blocks) * 3 * fwd_gemm_f + sum(3.5 * x for x in attn_f) + recomputed * fwd_gemm_f + attn_recomputed
    return Passes(forward, input_grad, weight_grad), flops, kernels


def deferred_parameters_per_block(model_cfg: GPTConfig, tp: int) -> int:
    """Elements of a block's parameters whose gradients ZB-H1's W computes on one tensor-parallel rank: the
    four linears' weights (3d·d + d·d + f·d + d·f)/tp and the column layers' biases (3d + f)/tp
    (model/weight_grads.py; a row layer adds its bias after the sum, so its gradient is B's)."""
    d, f = model_cfg.d_model, model_cfg.d_ff
    return (4 * d * d + 2 * d * f + 3 * d + f) // tp


def _per_weight_bytes(impl: Implementation) -> int:
    """Memory traffic per weight element and micro batch: autocast's casts and gradient accumulation."""
    return (20 if impl.fp32_weights else 10) if impl.autocast else 8


def uses_bf16_optimizer(zero_stage: int, impl: Implementation) -> bool:
    """DeepSpeed wraps the optimizer in BF16_Optimizer: bf16 weights at ZeRO 0 and 1 (train/planner/counts.py)."""
    return impl.bf16_weights and zero_stage <= 1


def block_seconds(model_cfg: GPTConfig, layout: Layout, impl: Implementation, hw: Hardware, block: int = 0) -> float:
    """Predicted time of transformer block `block`'s forward + backward for one micro batch on one
    tensor-parallel rank, communication left out: what bench/shard.py measures."""
    passes, _, kernels = _blocks_compute(model_cfg, layout, impl, hw, [block], 0)
    time = passes.total + block_elements(model_cfg, layout.tp) * _per_weight_bytes(impl) / hw.memory_bandwidth
    return max(time, kernels * impl.host_seconds_per_kernel)


def _stage_compute(model_cfg: GPTConfig, layout: Layout, impl: Implementation, hw: Hardware, stage: int,
                   shape: StageShape) -> tuple[Passes, float]:
    """(seconds by pass, hardware FLOPs) of one micro batch's forward + backward (+ recompute) on a rank.
    Beyond the blocks (_blocks_compute): the weights' traffic in B; the head's three unembedding products
    and its loss traffic, all in F with the fused loss (it makes both gradients in its forward), else one
    product and half the traffic in F; the embedding's traffic, half in F; under ZB-H1 with BF16_Optimizer
    under DeepSpeed's BF16_Optimizer each gradient's addition to its fp32 copy (BF16_OPTIMIZER_UPDATE_BYTES, two
    kernels a parameter), under ZB-H1 in W for the parameters W computes (the block linears' weights and the
    column layers' biases, whose bf16 gradients W makes fresh: nothing to clear or accumulate,
    parallel/zero_bubble_engine.py) and in B for the rest."""
    tp, d, n = layout.tp, model_cfg.d_model, layout.micro_batch * model_cfg.seq_len
    a, bandwidth = _matmul_bytes(impl), hw.memory_bandwidth
    blocks = list(stage_blocks(model_cfg.n_layer, layout.pp, stage))
    recomputed = checkpointed_blocks(shape, layout.checkpoint_every)
    passes, flops, host_kernels = _blocks_compute(model_cfg, layout, impl, hw, blocks, recomputed)
    forward, input_grad, weight_grad = passes.forward, passes.input_grad, passes.weight_grad
    params = rank_parameters(model_cfg, tp, layout.pp, stage)
    weights = sum(p.numel for p in params)
    bf16_optimizer = uses_bf16_optimizer(layout.zero_stage, impl)
    per_weight = _per_weight_bytes(impl) + (BF16_OPTIMIZER_UPDATE_BYTES if bf16_optimizer else 0)
    if bf16_optimizer:
        host_kernels += 2 * len(params)  # the update's cast and add, a parameter at a time
    if layout.zero_bubble and bf16_optimizer:  # W's parameters get fresh bf16 gradients, added to the fp32 ones
        deferred = len(blocks) * deferred_parameters_per_block(model_cfg, tp)  # in W (nothing cleared or +=)
        input_grad += (weights - deferred) * per_weight / bandwidth
        weight_grad += deferred * BF16_OPTIMIZER_UPDATE_BYTES / bandwidth
    else:
        input_grad += weights * per_weight / bandwidth
    if shape.head:  # the unembedding's GEMMs run over the padded vocabulary, Vp/p rows a rank
        vocab = unembedding_rows(model_cfg, tp)
        product = _gemm_time(hw, impl, n, d, vocab, a)
        loss = LOSS_BYTES * n * vocab / bandwidth
        if impl.fused_loss:
            forward += 3 * product + loss
        else:
            forward += product + loss / 2
            input_grad += 2 * product + loss / 2
        flops += 6 * n * d * vocab
    if shape.embedding:
        forward += 2 * FP32 * n * d / bandwidth
        input_grad += 2 * FP32 * n * d / bandwidth
    passes = Passes(forward, input_grad, weight_grad)
    host_s = host_kernels * impl.host_seconds_per_kernel
    return (passes.scaled_to(host_s) if host_s > passes.total else passes), flops


def _matmul_bytes(impl: Implementation) -> int:
    return 2 if impl.autocast else FP32


def _residual_bytes(impl: Implementation) -> int:
    return FP32 if impl.fp32_weights or not impl.autocast else 2


def _selective_recompute_per_token(d: int, f: int, tp: int, sequence_parallel: bool, impl: Implementation) -> float:
    """Bytes one token moves to recompute what selective recomputation dropped, in the backward:
    both LayerNorm forwards (read the kept input r·d, write the output a·d) unless sequence
    parallelism keeps their gathered outputs, and GELU's forward (read and write a·f/p)."""
    a, r = _matmul_bytes(impl), _residual_bytes(impl)
    gelu = 2 * a * f / tp
    return gelu if sequence_parallel else gelu + 2 * (r + a) * d


def _block_traffic_per_token(d: int, f: int, tp: int, sigma: int, impl: Implementation) -> float:
    """Bytes one token moves through memory-bound kernels in a block's forward: two LayerNorms
    (read and write the residual dtype r), two residual adds (read r and the matmul output, write r),
    GELU (read, write) and the head-merge copy; with gpt3d's fp32 residual stream under autocast
    also the bf16 casts of the two LayerNorm outputs the matmuls read. Backward moves about twice
    as much."""
    a, r = _matmul_bytes(impl), _residual_bytes(impl)
    layer_norms = 2 * 2 * r * d / sigma
    residuals = 2 * (2 * r + a) * d / sigma
    casts = 2 * (r + a) * d if impl.autocast and r != a else 0
    return layer_norms + residuals + casts + 2 * a * (d + f) / tp


def zero_optimizer_reduces(zero_stage: int, impl: Implementation) -> bool:
    """DeepSpeed's ZeRO optimizer (stage_1_and_2.py, stage3.py) holds the gradients: ZeRO ≥ 1, except
    bf16 at ZeRO 1, which DeepSpeed hands to BF16_Optimizer (train/planner/counts.py)."""
    return zero_stage >= 2 or (zero_stage == 1 and not impl.bf16_weights)


def _comm_time(transfers, hw: Hardware, inter_node: dict) -> float:
    return sum(t.sent / hw.link_bandwidth(inter_node[t.group]) + t.count * COLLECTIVE_LATENCY_S for t in transfers)


def held_at_peak(layout: Layout, stage: int, saved: int, deferred: int) -> tuple[int, int]:
    """(micro batches whose activations, W passes whose inputs and output gradients) `stage` holds at its
    activation peak, each micro batch `saved` bytes and each W pass `deferred`. 1F1B and DeepSpeed's
    engine keep i = min(pp − s, m) micro batches in flight (1 without a pipeline) and defer nothing. ZB-H1
    keeps the same i, and its stage s runs a W once it holds more than s (parallel/zero_bubble.py), so the
    peak is the larger of just after a forward, (i, min(s, m − i)), and just after a B, (i − 1,
    min(s + 1, m − i + 1)): exact for the order the engine runs, at every pp and m."""
    pp, m = layout.pp, layout.micro_batches
    if pp == 1:
        return 1, 0
    in_flight = min(pp - stage, m)
    if not layout.zero_bubble:
        return in_flight, 0
    after_forward = (in_flight, min(stage, m - in_flight))
    after_input_grad = (in_flight - 1, min(stage + 1, m - in_flight + 1))
    return max(after_forward, after_input_grad, key=lambda held: held[0] * saved + held[1] * deferred)


def _memory(layout: Layout, impl: Implementation, params, state: StateBytes, acts: ActivationBytes,
            in_flight: int, deferred: int, deferred_bytes: int, reduce_bucket: int) -> dict:
    """Bytes by kind at the rank's peak: the larger of the backward phase (activations of the micro
    batches in flight, ZB-H1's deferred W passes, gradients as they accumulate) and the optimizer step
    (gradients as ZeRO hands them over, AdamW's foreach temporaries, DeepSpeed's flattened buffers)."""
    dp, zero = layout.dp, layout.zero_stage
    n_local = sum(p.numel for p in params)
    common = {"weights": state.weights, "master": state.master, "moments": state.moments, "buffers": state.buffers}
    g = 2 if impl.bf16_weights else FP32  # a gradient element
    bf16_optimizer = uses_bf16_optimizer(zero, impl)  # its gradients are all there from the start
    grads_backward = {0: state.gradients, 1: state.gradients if bf16_optimizer else g * n_local,
                      2: state.gradients + g * min(reduce_bucket, n_local),
                      3: state.gradients}[zero]
    backward = {**common, "gradients": grads_backward, "activations": in_flight * acts.activations,
                "weight_copies": in_flight * acts.weight_copies, "deferred_weight_grads": deferred * deferred_bytes,
                "transient": max(acts.recompute, acts.cast_transient - acts.weight_copies, acts.loss_transient)}
    largest_group = max(sum(p.numel for p in params if p.decay), sum(p.numel for p in params if not p.decay))
    partitioned = zero > 0 or bf16_optimizer
    step_extra = FP32 * (state.partition if partitioned else largest_group)  # foreach sqrt of the second moment
    if zero_optimizer_reduces(zero, impl) and zero < 3:
        step_extra += FP32 * state.partition  # the flattened fp32 gradient partition
    if zero == 0 and dp > 1:
        step_extra += FP32 * min(REDUCE_BUCKET_SIZE, n_local)  # the flattened all-reduce bucket
    step = {**common, "gradients": state.gradients, "optimizer_transient": step_extra}
    return backward if sum(backward.values()) >= sum(step.values()) else step


def _stage_ranks(model_cfg: GPTConfig, layout: Layout, impl: Implementation, hw: Hardware, stages: list[int],
                 inter_node: dict) -> list[RankPlan]:
    """The RankPlans of `stages`, which hold the same layers: their state, activations, communication and
    time are one stage's, computed once; what each holds at its peak depends on the stage (held_at_peak)."""
    tp, pp, dp, m = layout.tp, layout.pp, layout.dp, layout.micro_batches
    stage = stages[0]
    params = rank_parameters(model_cfg, tp, pp, stage)
    shape = StageShape.of(model_cfg, pp, stage)
    bf16_weights, r = impl.bf16_weights, _residual_bytes(impl)
    comm_dtypes = (FP32, 2) if impl.autocast and tp == 1 else (FP32,)
    bucket = bucket_elements(model_cfg, tp)  # what train/planner/zero_buckets.py sets
    state = state_bytes(params, layout.zero_stage, dp, 0, layout.offload_optimizer, comm_dtypes,
                        bf16_weights=bf16_weights, reduce_bucket_size=bucket)
    acts = micro_batch_activations(
        model_cfg, tp, pp, stage, layout.micro_batch, sequence_parallel=layout.sequence_parallel,
        checkpoint_every=layout.checkpoint_every, autocast=impl.autocast, bf16_weights=bf16_weights,
        selective=layout.selective_recompute, fused_loss=impl.fused_loss,
    )
    a = _matmul_bytes(impl)
    deferred_bytes = deferred_weight_grad_bytes(model_cfg, tp, pp, stage, layout.micro_batch, a) if layout.zero_bubble else 0

    if impl.grad_reduce_bytes is not None:
        grad_bytes = lambda p: impl.grad_reduce_bytes  # noqa: E731
    elif bf16_weights:  # BF16_Optimizer (ZeRO ≤ 1) reduces its fp32 accumulation buffer
        grad_bytes = lambda p: FP32 if layout.zero_stage <= 1 else 2  # noqa: E731
    else:  # fp32 gradients; under autocast ZeRO ≥ 1 reduces plain nn.Linear ones in bf16
        grad_bytes = lambda p: 2 if impl.autocast and p.linear and layout.zero_stage > 0 else FP32  # noqa: E731
    tied = sum(p.numel for p in params if p.name.endswith("wte.weight"))
    transfers = (
        plan_comm.tensor_parallel(model_cfg, shape, tp, layout.micro_batch, m, sequence_parallel=layout.sequence_parallel,
                                  autocast=impl.autocast, residual_bytes=r, fused_loss=impl.fused_loss)
        + plan_comm.pipeline(model_cfg, shape, tp, pp, layout.micro_batch, m, tied,
                             sequence_parallel=layout.sequence_parallel, residual_bytes=r)
        # bf16 at ZeRO 0: BF16_Optimizer partitions the optimizer and so, like ZeRO 1, all-gathers the
        # updated weights after its step
        + plan_comm.data_parallel(params, dp, 1 if bf16_weights and layout.zero_stage == 0 else layout.zero_stage,
                                  m, flat_elements=state.details.get("flat", 0),
                                  grad_bytes=grad_bytes, weight_bytes=FP32 if impl.fp32_weights else 2)
    )
    passes, flops = _stage_compute(model_cfg, layout, impl, hw, stage, shape)
    optimizer_s = 0.0 if layout.offload_optimizer else OPTIMIZER_BYTES * (
        sum(p.numel for p in params) if layout.zero_stage == 0 else state.partition) / hw.memory_bandwidth
    if launch_priced(layout, impl):  # one GPU: the step launch by launch, as the step bill prices it
        step, update = one_gpu_step(model_cfg, layout.micro_batch, m, impl.precision, hw, impl.fused_loss,
                                    layout.checkpoint_every, layout.selective_recompute)
        passes, optimizer_s = passes.scaled_to((step.seconds - update.device_busy) / m), update.device_busy
    compute_s = passes.total
    tp_transfers = [t for t in transfers if t.group == "tp"]
    # under ZB-H1 the weight-gradient GEMM is deferred to W: nothing runs beside the input-gradient all-reduce
    overlap_tp = impl.overlap_tp and not layout.zero_bubble
    overlapped = [t for t in tp_transfers if overlap_tp and t.overlaps == plan_comm.WEIGHT_GRADIENT]
    tp_s = _comm_time([t for t in tp_transfers if t not in overlapped], hw, inter_node) / m
    tp_s += _exposed_behind_weight_gradients(model_cfg, layout, impl, hw, overlapped, inter_node) / m
    sends = [t for t in transfers if t.group == "pp" and t.op == "send"]
    pp_s = _comm_time(sends, hw, inter_node) / m
    gathers = [t for t in transfers if t.group == "dp" and t.phase == "forward"]
    gather_s = _comm_time(gathers, hw, inter_node) / m
    forward_comm_s = gather_s + (_comm_time([t for t in tp_transfers if t.phase == "forward"], hw, inter_node)
                                 + _comm_time([t for t in sends if t.phase == "forward"], hw, inter_node)) / m
    exposed = [t for t in transfers if t not in gathers and (t.group == "dp" or (t.group == "pp" and t.op != "send"))]
    overlap_dp = impl.overlap_dp and pp == 1 and zero_optimizer_reduces(layout.zero_stage, impl)
    hidden = [t for t in exposed if overlap_dp and t.overlaps == plan_comm.BACKWARD]
    backward_s = 2 / 3 * compute_s  # one micro batch's backward (module docstring)
    dp_s = _comm_time([t for t in exposed if t not in hidden], hw, inter_node)
    for t in hidden:  # ZeRO 2: each micro batch's reduction behind its backward; ZeRO 1: the last one's
        dp_s += t.count * max(0.0, _comm_time([t], hw, inter_node) / t.count - backward_s)
    micro_batch_s = compute_s + gather_s + tp_s + pp_s
    forward_s = passes.forward + forward_comm_s
    time = {
        "compute_s": compute_s, "tp_comm_s": tp_s, "pp_comm_s": pp_s, "zero3_gather_s": gather_s,
        "micro_batch_s": micro_batch_s,
        "forward_s": forward_s, "input_grad_s": micro_batch_s - forward_s - passes.weight_grad,
        "weight_grad_s": passes.weight_grad,
        "dp_comm_s": dp_s,
        "optimizer_s": optimizer_s,
    }
    parameters = sum(p.numel for p in params)
    ranks = []
    for s in stages:
        in_flight, deferred = held_at_peak(layout, s, acts.saved, deferred_bytes)
        memory = _memory(layout, impl, params, state, acts, in_flight, deferred, deferred_bytes, bucket)
        ranks.append(RankPlan(s, parameters, state, acts, in_flight, deferred, deferred_bytes, memory,
                              sum(memory.values()), flops * m, transfers, time))
    return ranks


def launch_priced(layout: Layout, impl: Implementation) -> bool:
    """Whether the plan prices the step launch by launch (train/planner/one_gpu.py): the whole model on one GPU
    (tp = pp = dp = 1) in bf16 and eager (the GPU's default step, whose launch list is the bill of), with
    DeepSpeed's bf16 optimizer, nothing offloaded; else by FLOPs and bytes (this module), as validated against the
    measured steps of tests/train/planner/test_plan_validation.py: so fp8 and compiled blocks, which the launch list
    does not describe, compare with bf16 by one model."""
    return (layout.tp == layout.pp == layout.dp == 1 and layout.zero_stage <= 1 and not layout.offload_optimizer
            and impl.precision == "bf16" and not impl.compiled)


def _exposed_behind_weight_gradients(model_cfg: GPTConfig, layout: Layout, impl: Implementation, hw: Hardware,
                                     transfers, inter_node: dict) -> float:
    """Seconds per step of the column layers' input-gradient collectives that their weight-gradient
    GEMMs do not hide: each block's attn.qkv and mlp.fc collective against that layer's GEMM
    (n×d)ᵀ·(n×3d/p), (n×d)ᵀ·(n×f/p)."""
    tp, n, d = layout.tp, layout.micro_batch * model_cfg.seq_len, model_cfg.d_model
    gemms = (_linear_time(hw, impl, d, n, 3 * d // tp), _linear_time(hw, impl, d, n, model_cfg.d_ff // tp))
    exposed = 0.0
    for t in transfers:  # count: 2 per block and micro batch, one for each column layer
        each = _comm_time([t], hw, inter_node) / t.count
        exposed += t.count / 2 * sum(max(0.0, each - gemm) for gemm in gemms)
    return exposed


def build_plan(
    model_cfg: GPTConfig, layout: Layout, hardware: Hardware, *, implementation: Implementation = Implementation(),
    gpus_per_node: int = 8, reserved_gib: float = 0.0, tokens: float = 300e9,
) -> Plan:
    """The prediction for `layout` (see module docstring); ranks: first, middle and last stage."""
    tp, dp, m = layout.tp, layout.dp, layout.micro_batches
    inter_node = {"tp": tp > gpus_per_node, "pp": tp * dp >= gpus_per_node, "dp": tp * dp > gpus_per_node}
    alike = {}  # stages with the same layers predict the same time: each kind computed once
    for s in range(layout.pp):
        blocks = stage_blocks(model_cfg.n_layer, layout.pp, s)
        alike.setdefault((StageShape.of(model_cfg, layout.pp, s), len(blocks), blocks.start % 2), []).append(s)
    stages = sorted((rank for members in alike.values()
                     for rank in _stage_ranks(model_cfg, layout, implementation, hardware, members, inter_node)),
                    key=lambda rank: rank.stage)
    slowest = max(stages, key=lambda r: r.time["micro_batch_s"])
    pipeline = PipelineTime(m, slowest, pipeline_seconds(layout.schedule, layout.pp, m, slowest.passes))
    step_s = pipeline.seconds + max(r.time["dp_comm_s"] + r.time["optimizer_s"] for r in stages)
    shown = sorted({0, layout.pp // 2, layout.pp - 1})
    return Plan(
        model=model_cfg, layout=layout, hardware=hardware, implementation=implementation,
        ranks=[stages[s] for s in shown], pipeline=pipeline, step_time_s=step_s,
        model_flops_per_step=model_flops_per_token(model_cfg) * layout.global_batch * model_cfg.seq_len,
        hardware_flops_per_step=sum(r.hardware_flops for r in stages) * tp * dp,
        reserved_gib=reserved_gib, tokens=tokens, gpus_per_node=gpus_per_node, notes=_notes(layout),
    )


def _notes(layout: Layout) -> list[str]:
    notes = []
    if layout.offload_optimizer:
        notes.append("optimizer offload: the CPU optimizer's time and the host transfers are not modelled")
    return notes
