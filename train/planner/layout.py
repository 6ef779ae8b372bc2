"""What the planner plans: a parallel layout with its batch geometry and pipeline schedule (`Layout`), and how
the trainer runs the math (`Implementation`, by train.precision through `for_precision`)."""

from __future__ import annotations

from dataclasses import dataclass

from parallel.schedules.orders import INTERLEAVED, ONE_F_ONE_B, SPLIT_BACKWARD, placement_of
from parallel.schedules.placement import Placement
from train.config.sections.train import FP8_ALL


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
    schedule: str = ONE_F_ONE_B  # parallel.pipeline_schedule (only with pp > 1)
    virtual_stages: int = 1  # parallel.virtual_stages: chunks a rank under the interleaved schedule
    stage_layers: tuple[int, ...] | None = None  # parallel.stage_layers: blocks per virtual stage; None: balanced

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def placement(self) -> Placement:
        """Where the virtual stages run (parallel/schedules/placement.py): one chunk a rank but for the
        interleaved schedule (virtual_stages) and zb-v (2, in a V)."""
        return placement_of(self.schedule, self.pp, self.virtual_stages) if self.pp > 1 else Placement(1)

    @property
    def own_engine(self) -> bool:
        """gpt3d's ScheduleEngine runs the pipeline (every schedule but DeepSpeed's 1f1b)."""
        return self.pp > 1 and self.schedule != ONE_F_ONE_B

    @property
    def defers_weight_grads(self) -> bool:
        """The blocks defer their weight gradients to W passes: a pipeline under zb-h1 or zb-v."""
        return self.pp > 1 and self.schedule in SPLIT_BACKWARD

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
        if self.schedule == INTERLEAVED:
            parts.append(f"interleaved V={self.virtual_stages}")
        elif self.schedule != ONE_F_ONE_B:
            parts.append(self.schedule)
        if self.stage_layers is not None:
            parts.append("stages=" + ",".join(map(str, self.stage_layers)))
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
    # parallel.tp_comm_overlap: under sequence parallelism the block linears' all-gathers and reduce-scatters run
    # in tp − 1 ring exchanges, each behind a chunk of the layer's GEMM (parallel/overlap.py)
    ring_tp: bool = False
    # assumed, not measured: a GEMM chunk runs this much slower beside a ring exchange (NCCL's send and receive
    # kernels take some of the SMs; Transformer Engine's copy-engine exchanges take fewer)
    ring_gemm_slowdown: float = 0.1
    # the ring layers' kernels launched one by one from Python (gpt3d's parallel/overlap.py: RING_LAUNCHES); False
    # for a ring run from C++ (Transformer Engine's userbuffers), whose launches the block's count covers
    ring_launches: bool = True
    # Megatron-Core's distributed optimizer (overlap_grad_reduce, overlap_param_gather), for published runs only:
    # under the interleaved schedule each chunk's gradients reduce while later chunks run backward and its weights
    # gather while earlier ones run forward, so 1/V of the data-parallel communication stays exposed (all of it at
    # V = 1)
    chunked_dp_overlap: bool = False
    # gpt3d's engine under the interleaved schedule (parallel.overlap_communication; estimate.chunk_reductions_run):
    # each chunk's gradient reduction issued after its last B, the updated weights gathered after the step
    chunked_grad_reduction: bool = False
    overlap_dp: bool = False  # ZeRO 1/2 reduce gradients in buckets during the backward (overlap_comm)
    fused_loss: bool = True  # train.fused_loss: the loss unembeds chunk by chunk, no (n, Vp/p) logits kept
    # measured on this project's H100 (README, "How the step time is modelled"):
    attention_efficiency: float = 0.21  # the fused attention's forward+backward, 212 of 989 TFLOP/s
    # for published runs only: the attention as Megatron-LM ran it before fused attention kernels, its T × T scores
    # written out between batched GEMMs, a softmax and the attention dropout (estimate._attention)
    materialized_attention: bool = False
    # for published runs only: activations laid out sequence first (Megatron's (T, B, d)), so that a sequence piece is
    # contiguous and the ring copies nothing (estimate.scattered_copies)
    sequence_first: bool = False
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


def for_precision(precision: str, overlap_communication: bool = True, fused_loss: bool = True,
                  fp8_recipe: str = "tensorwise", compiled: bool = False, fp8_linears=FP8_ALL,
                  tp_comm_overlap: bool = False) -> Implementation:
    """gpt3d under train.precision (auto resolved by the caller): fp32 everything; autocast (fp32
    weights, bf16 matmuls with per-micro-batch casts); bf16 (bf16 weights and gradients, fp32 master
    weights and moments in the optimizer); fp8 (bf16, and the blocks' linears in float8 by
    `fp8_recipe`, on the linears `fp8_linears` says: train.fp8_linears, or a run's resolved names).
    overlap_communication: parallel.overlap_communication, and DeepSpeed's overlap_comm set from the plan
    (train/planner/zero_buckets.py); fused_loss: train.fused_loss; compiled: model.compile; tp_comm_overlap:
    parallel.tp_comm_overlap (with fp8, the tensorwise recipe only, as the trainer takes it)."""
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision={precision!r}: must be one of {['auto', *PRECISIONS]}")
    if tp_comm_overlap and precision == "fp8" and fp8_recipe != "tensorwise":
        raise ValueError(f"parallel.tp_comm_overlap=true with train.fp8_recipe={fp8_recipe}: the ring sends each "
                         "operand quantized once, which only the tensorwise recipe allows; plan tensorwise, or "
                         "tp_comm_overlap=false")
    return Implementation(
        fp32_weights=precision in ("fp32", "autocast"), autocast=precision != "fp32",
        overlap_tp=overlap_communication, overlap_dp=overlap_communication, chunked_grad_reduction=overlap_communication,
        fused_loss=fused_loss,
        fp8=fp8_recipe if precision == "fp8" else None, compiled=compiled,
        fp8_linears=tuple(fp8_linears) if isinstance(fp8_linears, (list, tuple)) else fp8_linears,
        ring_tp=tp_comm_overlap,
    )
