"""Communication of one training step, per rank and process group, counted from what gpt3d's
layers and DeepSpeed send.

Each collective is a `Transfer`: the size of the full tensor involved (`nbytes`, the quantity
parallel/comm.py records: the all-reduced tensor, the gathered output, the reduce-scattered input)
and how often one step runs it. What a rank puts on the wire follows from the algorithm: a ring
all-reduce over g ranks sends 2(g−1)/g·nbytes, an all-gather or reduce-scatter (g−1)/g·nbytes, a
point-to-point send nbytes.

Tensor parallel (per micro batch, n = b·T tokens; see parallel/tensor.py):
  without sequence parallelism, each block all-reduces n·d twice forward (after attn.proj and
  mlp.proj) and twice backward (input gradients of attn.qkv and mlp.fc); outside the blocks the
  embedding (forward) and the unembedding's input gradient (backward) all-reduce n·d and the loss
  three vectors of n floats (the fused loss: three of C floats for each chunk of C tokens,
  model/fused_loss.py token_chunk). With sequence parallelism each all-reduce of a block becomes an
  all-gather before and a reduce-scatter after the column/row pair, in both passes; LayerNorm
  weights and row-parallel biases all-reduce their d-sized gradients; the embedding output is
  scattered (its backward all-gathers). Element sizes: a row-parallel output is the matmul's dtype
  (bf16 under autocast), everything else the residual stream's (fp32; bf16 with bf16 weights).
Pipeline (per micro batch): the stage output (n·d in the residual dtype) and the targets (n int64s,
  whole: the last stage computes the loss) to the next stage forward,
  its gradient to the previous stage backward (with tp > 1 partitioned over the tp ranks, or under
  sequence parallelism each rank's own part, see `pipeline`); per step the tied embedding's gradient
  is all-reduced between the first and last stage.
Data parallel (DeepSpeed 0.19, as its communication logger records it): ZeRO 0 all-reduces every
  gradient once per step (in the gradients' dtype); ZeRO 1 too, then all-gathers the updated parameter partitions; ZeRO 2
  all-reduces after every micro batch; ZeRO 3 all-gathers partitioned parameters for each micro
  batch, reduce-scatters gradients after each, and refreshes the persistent parameters once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from model import GPTConfig
from model.fused_loss import token_chunk
from train.planner.activations import INT64, StageShape, unembedding_rows
from train.planner.counts import FP32, PERSISTENCE_THRESHOLD, ParamShape

WEIGHT_GRADIENT = "column layer's weight-gradient GEMM"  # parallel.overlap_communication
BACKWARD = "backward of the micro batch"  # DeepSpeed's zero_optimization.overlap_comm
RING = "ring steps behind the layer's GEMM chunks"  # parallel.tp_comm_overlap (parallel/overlap.py)
# the ring's collectives of a block (parallel/overlap.py), one pair of linears each: (attention's linear, the MLP's,
# op, phase, what); a gather carries the linear's input (forward) or its output gradient (backward)
RING_COLLECTIVES = (
    ("attn.qkv", "mlp.fc", "all_gather", "forward", "LayerNorm output gathered"),
    ("attn.proj", "mlp.proj", "reduce_scatter", "forward", "row-parallel output"),
    ("attn.qkv", "mlp.fc", "reduce_scatter", "backward", "input gradient"),
    ("attn.proj", "mlp.proj", "all_gather", "backward", "output gradient gathered"),
)
MAX_REUSE_DISTANCE = 1_000_000_000  # DeepSpeed's default stage3_max_reuse_distance (elements)
RING_FACTOR = {"all_reduce": lambda g: 2 * (g - 1) / g, "all_gather": lambda g: (g - 1) / g,
               "reduce_scatter": lambda g: (g - 1) / g, "send": lambda g: 1.0}


@dataclass(frozen=True)
class Transfer:
    """`count` collectives `op` of `nbytes` each per step, over a group of `group_size` ranks."""

    group: str  # "tp" | "pp" | "dp"
    op: str
    phase: str  # "forward" | "backward" | "step"
    nbytes: int
    count: int
    group_size: int
    what: str
    overlaps: str = ""  # the computation it may run alongside when the layout overlaps it ("" none)
    linear: str = ""  # under RING: the block linear (a name of BLOCK_LINEARS) whose GEMM chunks it runs behind

    @property
    def total(self) -> int:
        """Bytes of the collectives' tensors per step (parallel/comm.py's measure)."""
        return self.nbytes * self.count

    @property
    def sent(self) -> float:
        """Bytes this rank puts on the wire per step (ring algorithms)."""
        return self.total * RING_FACTOR[self.op](self.group_size)


def tensor_parallel(
    config: GPTConfig, shape: StageShape, tp: int, micro_batch: int, micro_batches: int, *,
    sequence_parallel: bool = False, autocast: bool = True, residual_bytes: int = FP32, fused_loss: bool = True,
    ring: bool = False, float8_linears: frozenset = frozenset(),
) -> list[Transfer]:
    """Tensor-parallel collectives of one step on a stage (module docstring). `act32` below is a
    tensor of the residual stream (residual_bytes an element), `act_mm` a matmul output. ring
    (parallel.tp_comm_overlap, with sequence parallelism): each block linear runs its two collectives in
    ring steps behind its GEMM (`RING`, one Transfer per linear), the column layers' in the matmul dtype (each
    gathers its input cast, and reduce-scatters its input gradient as computed); the gathers of the linears in
    `float8_linears` (train.precision=fp8, tensorwise) travel quantized, a byte an element
    (parallel/ring_operands.py)."""
    if tp == 1:
        return []
    n = micro_batch * config.seq_len
    act32 = n * config.d_model * residual_bytes
    act_mm = n * config.d_model * (2 if autocast or residual_bytes == 2 else FP32)
    blocks, m = shape.blocks, micro_batches

    def t(op, phase, nbytes, per_mb, what, overlaps=""):
        return Transfer("tp", op, phase, nbytes, per_mb * m, tp, what, overlaps)

    out = []
    if sequence_parallel and ring:
        for attention, mlp, op, phase, what in RING_COLLECTIVES:
            for name in (attention, mlp):
                quantized = op == "all_gather" and name in float8_linears
                out.append(Transfer("tp", op, phase, n * config.d_model if quantized else act_mm, blocks * m, tp,
                                    f"{what} ({name})", RING, name))
        out.append(t("all_reduce", "backward", config.d_model * FP32, 6 * blocks, "LayerNorm and row-bias gradients"))
    elif sequence_parallel:
        out += [
            t("all_gather", "forward", act32, 2 * blocks, "LayerNorm output to the column layers"),
            t("reduce_scatter", "forward", act_mm, 2 * blocks, "row-parallel outputs"),
            t("reduce_scatter", "backward", act32, 2 * blocks, "gradients of the LayerNorm outputs"),
            t("all_gather", "backward", act_mm, 2 * blocks, "gradients of the row-parallel outputs"),
            t("all_reduce", "backward", config.d_model * FP32, 6 * blocks, "LayerNorm and row-bias gradients"),
        ]
    else:
        out += [
            t("all_reduce", "forward", act_mm, 2 * blocks, "attn.proj and mlp.proj outputs"),
            t("all_reduce", "backward", act32, 2 * blocks, "input gradients of attn.qkv and mlp.fc", WEIGHT_GRADIENT),
        ]
    if shape.embedding:
        out.append(t("all_reduce", "forward", act32, 1, "vocab-parallel embedding"))
        if sequence_parallel:
            out.append(t("all_gather", "backward", act32, 1, "gradient of the scattered embedding output"))
    if shape.head:
        if sequence_parallel:
            out += [
                t("all_gather", "forward", act32, 1, "final LayerNorm output"),
                t("reduce_scatter", "backward", act32, 1, "gradient of the final LayerNorm output"),
                t("all_reduce", "backward", config.d_model * FP32, 2, "final LayerNorm gradients"),
            ]
        else:
            out.append(t("all_reduce", "backward", act32, 1, "input gradient of the unembedding"))
        what = "vocab-parallel loss (max, target logit, sum)"
        matmul_bytes = 2 if autocast or residual_bytes == 2 else FP32
        chunk = token_chunk(n, unembedding_rows(config, tp), matmul_bytes) if fused_loss else n
        full, rest = divmod(n, chunk)
        out.append(t("all_reduce", "forward", chunk * FP32, 3 * full, what))
        out.append(t("all_reduce", "forward", rest * FP32, 3 if rest else 0, what))
    return [x for x in out if x.count]


def pipeline(config: GPTConfig, shape: StageShape, tp: int, pp: int, micro_batch: int, micro_batches: int,
             tied_gradient_elements: int, *, sequence_parallel: bool = False,
             residual_bytes: int = FP32) -> list[Transfer]:
    """Pipeline traffic of one step by a stage: point-to-point sends, the tied-embedding all-reduce,
    and with tp > 1 DeepSpeed's partitioned sends (each tp rank sends 1/tp of the tensor and the
    receiver all-gathers it over its tp group; a stage also re-gathers its own kept output before
    running backward from it). Under sequence parallelism train/run/engine.py turns partitioning off:
    each tp rank holds and sends its own 1/tp of the sequence whole, and nothing is gathered."""
    if pp == 1:
        return []
    act = micro_batch * config.seq_len * config.d_model * residual_bytes
    m, out = micro_batches, []
    if not shape.head:
        out.append(Transfer("pp", "send", "forward", act // tp, m, 2, "stage output to the next stage"))
        out.append(Transfer("pp", "send", "forward", micro_batch * config.seq_len * INT64, m, 2,
                            "the targets, with the stage output (parallel/pipeline.py)"))
    if not shape.embedding:
        out.append(Transfer("pp", "send", "backward", act // tp, m, 2, "input gradient to the previous stage"))
    if tp > 1 and not sequence_parallel:
        gathers = m * ((not shape.embedding) + 2 * (not shape.head))
        out.append(Transfer("tp", "all_gather", "pipeline", act, gathers, tp, "partitioned pipeline tensors"))
    if shape.embedding or shape.head:
        out.append(Transfer("pp", "all_reduce", "step", tied_gradient_elements * FP32, 1, 2,
                            "tied embedding gradient, first and last stage"))
    return [x for x in out if x.count]


def data_parallel(
    params: list[ParamShape], dp: int, zero_stage: int, micro_batches: int, *, flat_elements: int = 0,
    grad_bytes=lambda p: FP32, weight_bytes: int = FP32,
) -> list[Transfer]:
    """Data-parallel collectives of one step by a rank holding `params`, as DeepSpeed 0.19 runs them.

    flat_elements: ZeRO 1/2's padded flat parameter count (plan_counts.StateBytes.details["flat"]);
    grad_bytes(p): element size p's gradient is reduced in (fp32; under autocast ZeRO
    reduces plain nn.Linear gradients in bf16); weight_bytes: element size of the parameters ZeRO
    gathers (gpt3d: fp32; a trainer with bf16 parameters: 2).
    """
    if dp == 1:
        return []
    grads = sum(p.numel * grad_bytes(p) for p in params)
    if zero_stage == 0:
        return [Transfer("dp", "all_reduce", "step", grads, 1, dp, "gradients")]
    if zero_stage in (1, 2):
        reduces = 1 if zero_stage == 1 else micro_batches  # ZeRO-2 reduces after every micro batch
        return [
            Transfer("dp", "all_reduce", "step" if zero_stage == 1 else "backward", grads, reduces, dp, "gradients",
                     BACKWARD),
            Transfer("dp", "all_gather", "step", flat_elements * weight_bytes, 1, dp, "updated parameters"),
        ]
    padded = [(p, -(-p.numel // dp) * dp) for p in params]
    gathered = sum(n for p, n in padded if p.numel > PERSISTENCE_THRESHOLD) * weight_bytes
    persistent = sum(n for p, n in padded if p.numel <= PERSISTENCE_THRESHOLD) * weight_bytes
    # DeepSpeed keeps a gathered parameter until its next use when that comes within
    # stage3_max_reuse_distance (1e9 elements): then one gather serves forward and backward.
    per_micro_batch = 1 if gathered // weight_bytes <= MAX_REUSE_DISTANCE else 2
    return [x for x in [
        Transfer("dp", "all_gather", "forward", gathered, per_micro_batch * micro_batches, dp, "partitioned parameters"),
        Transfer("dp", "all_gather", "step", persistent, 1, dp, "updated persistent parameters"),
        Transfer("dp", "reduce_scatter", "backward", sum(n * grad_bytes(p) for p, n in padded), micro_batches, dp, "gradients"),
    ] if x.total]
