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
  passes   t_mb = t_F + t_B + t_W (`Passes`, train/planner/pipeline_time.py): W is the blocks' deferrable
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
  pipeline every rank timed as the slowest one (largest t_mb over all its chunks), by
           parallel.pipeline_schedule (train/planner/pipeline_time.py: 1f1b, zb-h1, interleaved, zb-v);
           a rank holding V chunks (interleaved, zb-v) is timed chunk by chunk, each chunk as a virtual
           stage of the layout's P = pp·V (its layers, sends and tied matrix), and summed
  step     = pipeline + the data-parallel collectives, tied-embedding all-reduce and optimizer (not overlapped,
           but the chunk reductions below)

Activation memory at a rank's peak: under 1F1B, min(pp − s, m) micro batches' saved activations;
under ZB-H1 also the deferred W passes, each holding every block linear's input x and output
gradient g (activations.deferred_weight_grad_bytes), at the larger of two moments: just after a
forward, i = min(pp − s, m) micro batches and min(s, m − i) W passes, and just after a B, i − 1 and
min(s + 1, m − i + 1) (`held_at_peak`: exact for the engine's order at every pp and m); under the
interleaved schedule and zb-v the largest sum along the rank's own order of its chunks' saved bytes
and deferred W bytes (`chunks_held_at_peak`). Every schedule sends the same messages for each pair of
consecutive virtual stages on two ranks.

Collectives run at the achieved link bandwidth (NVLink inside a node, the network between nodes)
plus a fixed latency each. Only what the code overlaps is hidden:
  - with `Implementation.overlap_tp` (parallel.overlap_communication), the column layers' backward
    input-gradient all-reduce runs while the same layer's weight-gradient GEMM computes: each is
    exposed by max(0, collective − that GEMM). Under sequence parallelism the code does not overlap
    (the reduce-scatter of those gradients runs after the layer's backward) and neither does the plan;
    under zb-h1 and zb-v that GEMM is deferred to W and the all-reduce runs in B with nothing beside it
    (parallel/tensor.py): exposed whole;
  - with `Implementation.ring_tp` (parallel.tp_comm_overlap, under sequence parallelism), each block linear's
    all-gather and reduce-scatter runs as p − 1 ring exchanges, each behind 1/p of that layer's GEMM
    (parallel/overlap.py): exposed (p − 1)·(max(exchange, (1 + s)·G/p) − G/p) (`_exposed_in_ring_steps`);
  - under gpt3d's own schedules (zb-h1, interleaved, zb-v) the pipeline's sends are asynchronous and
    their receives posted ahead (parallel/schedules/engine.py): each is exposed by max(0, send − the
    chunk's next pass, its forward or its B);
  - with `Implementation.overlap_dp` (DeepSpeed's zero_optimization.overlap_comm; its ZeRO optimizer
    at ZeRO 1 and 2, not bf16's BF16_Optimizer, which reduces after the backward; pp = 1), the gradient
    reduction runs in buckets during the backward that produces the gradients:
    ZeRO 2 reduces each micro batch during its own backward, ZeRO 1 only at the last micro batch;
    exposed is max(0, reduction − one micro batch's backward), the backward taken as 2/3 of the micro
    batch's compute (its GEMM FLOPs are twice the forward's; recomputation only lengthens it). Under
    DeepSpeed's pipeline engine the reduction waits for the end of the last backward
    (PipeEngine._exec_reduce_grads is the only gradient-accumulation boundary), so nothing hides;
  - with `Implementation.chunked_grad_reduction` (parallel.overlap_communication) under the interleaved
    schedule with BF16_Optimizer and dp > 1, each chunk's reduction is issued after its last B
    (parallel/schedules/grad_reduction.py) and hides in the backward passes of the chunks after it
    (`chunk_reductions_run`, `_exposed_chunk_reductions`);
Nothing else overlaps: not the other tensor-parallel collectives (the next matmul needs their
result), not DeepSpeed's 1F1B sends (they block), not ZeRO 1's all-gather of the updated parameters, and not ZeRO-3's parameter
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

from functools import lru_cache, partial

from model import GPTConfig, flops_per_token
from model.modes import BLOCK_LINEARS
from parallel.schedules.grad_reduction import reduces_chunks
from parallel.schedules.orders import ONE_F_ONE_B, ZB_V, Costs
from train.planner import comm as plan_comm
from train.planner.activations import (
    ActivationBytes,
    StageShape,
    checkpointed_blocks,
    deferred_weight_grad_bytes,
    micro_batch_activations,
    received_activation_bytes,
    unembedding_rows,
)
from train.planner.counts import (
    FP32,
    REDUCE_BUCKET_SIZE,
    StateBytes,
    block_elements,
    bucket_elements,
    chunked_rank_parameters,
    rank_parameters,
    stage_blocks,
    state_bytes,
)
from train.planner.fp8_rule import COLUMN_PARALLEL, linear_shapes, linears_at
from train.planner.hardware import Hardware
from train.planner.layout import PRECISIONS, Implementation, Layout, for_precision
from train.planner.one_gpu import one_gpu_step
from train.planner.pipeline_time import Passes, PipelineTime, chunks_held_at_peak, held_at_peak, pipeline_seconds
from train.planner.results import GIB, Plan, RankPlan

# what the planner's users import from here: the layout, the implementation, the results
__all__ = ["GIB", "PRECISIONS", "Implementation", "Layout", "Passes", "Plan", "RankPlan", "build_plan", "for_precision"]
COLLECTIVE_LATENCY_S = 15e-6  # per collective call (NCCL launch and ring start-up)
OPTIMIZER_BYTES = 64  # memory traffic per updated element: AdamW (p, g, m, v read, p, m, v written,
#                       foreach temporaries) plus the gradient-norm and clipping passes
SELECTIVE_KERNELS = 3  # kernels selective recomputation adds per block: two LayerNorms and a GELU
LOSS_BYTES = 32  # memory traffic per logit: float copy, log-softmax, its backward, cast back
# Memory traffic per parameter element and micro batch of DeepSpeed's BF16_Optimizer (ZeRO ≤ 1 with bf16
# weights) adding the micro batch's bf16 gradient to its fp32 one, as gpt3d runs it (train/run/bf16_optimizer.py:
# one add that casts as it reads, a kernel a parameter: the bf16 gradient read 2, the fp32 one read 4 and
# written 4; DeepSpeed's own casts to a temporary first, 18 bytes in two kernels), under either schedule; beside
# the clearing and accumulation of the bf16 gradient (_per_weight_bytes)
BF16_OPTIMIZER_UPDATE_BYTES = 10


# Bytes of memory traffic per element of x, W and g of a linear layer, per micro batch, for its float8 casts
# (model/float8.py, each cast one pass writing the layout _scaled_mm takes: model/float8_cast_triton.py eager,
# inductor's fusion compiled): each cast reads its bf16 operand for the amax (2) unless the amax is known, then
# again to scale it and writes float8 (3). Tensorwise: each operand's amax once, its two casts (one per product
# it enters) 3 each: x, W, g 8 each; rowwise: every cast has its own amax, 10 each.
FP8_CAST_BYTES = {"tensorwise": 8, "rowwise": 10}


def ring_fp8_cast_bytes(column: bool, tp: int, micro_batches: int, copied: bool) -> tuple[float, float, float]:
    """FP8_CAST_BYTES under parallel.tp_comm_overlap (parallel/ring_operands.py, tensorwise only), per element of
    the whole operand and micro batch, (x, W, g) of a column layer (column) or a row layer: x and g cast once (the
    amax 2, the cast 3) and copied into their other layout for the weight gradient (a float8 byte read and
    written, 2), the pieces that travel cast before the ring (1/p of the whole on each rank); the operand the ring
    scatters (a column layer's g, a row layer's x) copied once more into sequence-major pieces (`copied`:
    scattered_copies; parallel/overlap.py's _pieces, 2); W's amax and two casts (8) made once a step and kept
    (model/float8_weights.py): 8 over the step's micro batches."""
    piece, whole = 5 / tp + 2, 7 + (2 if copied else 0)
    return (piece, 8 / micro_batches, whole) if column else (whole, 8 / micro_batches, piece)


# Launches a block linear under parallel.tp_comm_overlap adds, per micro batch (forward and backward), to the same
# linear under plain sequence parallelism: a + b·p at tp = p, by (float8, column layer). Counted by
# bench/op_ledger.py on the layers themselves at p = 2 and 4, inside a training step whose float8 weight casts are
# kept (tests/train/planner/test_plan_ring_launches.py): each ring step's exchanges (a send and a receive each way),
# GEMM chunks and partial-sum addition, the gathers' joins, the scattered operand's one sequence-major copy; in
# float8 also the layer's amaxes, scales (one kernel with their inverses) and casts, outside any compiled graph
# (the ring layers run eager). A float8 layer's first micro batch of a step also makes its weight's amax, scale
# and two casts: RING_WEIGHT_CAST_LAUNCHES more, once a step. With one sequence a micro batch the scattered operand's
# pieces are contiguous already: RING_COPY_LAUNCHES fewer (scattered_copies).
RING_LAUNCHES = {(False, True): (-4, 7), (False, False): (-9, 7), (True, True): (6, 7), (True, False): (1, 7)}
RING_WEIGHT_CAST_LAUNCHES = 4
RING_COPY_LAUNCHES = 1  # of RING_LAUNCHES (counted at two sequences a micro batch): the scattered operand's copy


# All-reduces of amaxes per float8 linear and micro batch under tensor parallelism (model/float8.py's table):
# tensorwise, a column layer's W (forward) and g (backward), a row layer's x and W (forward, one call): 2 and 1;
# rowwise, a column layer's input grad and a row layer's forward: 1 each. (Column, row) per recipe.
FP8_AMAX_REDUCTIONS = {"tensorwise": (2, 1), "rowwise": (1, 1)}
RING_FP8_AMAX_REDUCTIONS = (2, 2)  # under the ring: x and W forward (one call), g backward, in either layer
# Kernels one block linear adds in float8, forward and backward, eager: amaxes (one reduction each), scales, the
# casts (one fused kernel each, model/float8.py's float8_cast), the scaled products (kernels counted on one linear
# by bench/op_ledger.py: 52 tensorwise and 81 rowwise, against the plain linear's 6; most of what remains is the
# scale arithmetic on single numbers). At 30 µs of host time each they bound a large model's micro batch unless
# model.compile fuses them (Implementation.compiled: none added; their memory traffic is still counted).
FP8_KERNELS_PER_LINEAR = {"tensorwise": 46, "rowwise": 75}


@lru_cache(maxsize=64)
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


def _linear_time(hw: Hardware, impl: Implementation, n: int, k: int, m: int, fp8: bool = True,
                 cast_bytes: tuple | None = None) -> float:
    """One block linear's product (n×k)·(k×m): in the compute dtype, or (fp8, under train.precision=fp8) in
    float8 with its share of the casts (a third of the layer's: cast_bytes, per element of x, W and g, covers its
    three products; None: FP8_CAST_BYTES of each)."""
    if impl.fp8 is None or not fp8:
        return _gemm_time(hw, impl, n, k, m, _matmul_bytes(impl))
    x, w, g = cast_bytes or (FP8_CAST_BYTES[impl.fp8],) * 3
    casts = (x * n * k + w * k * m + g * n * m) / 3
    return _fp8_gemm_time(hw, n, k, m) + casts / hw.memory_bandwidth


def _blocks_compute(model_cfg: GPTConfig, layout: Layout, impl: Implementation, hw: Hardware, blocks: list[int],
                    recomputed: int) -> tuple[Passes, float, float]:
    """(seconds by pass, hardware FLOPs, host kernels) of `blocks`' forward + backward of one micro batch
    on a rank, `recomputed` of them inside checkpointed segments: GEMMs, attention, memory-bound traffic
    and selective recomputation (not the weights' casts and gradient accumulation).

    Per block, with G the time of one product of each of its four linears (a linear's three products
    have the same FLOPs and matrices of the same three sizes, so the model times them alike), X its
    forward traffic and A its attention's forward (QKᵀ and PV; `_attention`): F = G + X + A; W = G + the column
    layers' bias sums (read g, a·n·(3d + f)/p bytes); B = G + 2X + the attention's backward − the bias sums, plus
    recomputation and the fp8 amax reductions; under the ring, its copies of the scattered operands (the row
    layers' x in F, the column layers' g in B; scattered_copies). F + B + W is the block's whole micro batch."""
    tp, sigma = layout.tp, layout.tp if layout.sequence_parallel else 1
    d, f, n = model_cfg.d_model, model_cfg.d_ff, layout.micro_batch * model_cfg.seq_len
    bandwidth = hw.memory_bandwidth
    gemms = [(n, d, 3 * d // tp), (n, d // tp, d), (n, d, f // tp), (n, f // tp, d)]  # in BLOCK_LINEARS' order
    in_fp8 = linears_at(model_cfg, layout, impl, hw)  # the block linears in float8 (none without fp8)
    ring = ring_runs(layout, impl)  # float8 operands cast once (ring_fp8_cast_bytes)
    copied = ring and scattered_copies(layout, impl)
    casts = {name: ring_fp8_cast_bytes(name in COLUMN_PARALLEL, tp, layout.micro_batches, copied)
             if ring else None for name in BLOCK_LINEARS}
    fwd_gemm_t = sum(_linear_time(hw, impl, *g, fp8=name in in_fp8, cast_bytes=casts[name])
                     for name, g in zip(BLOCK_LINEARS, gemms))
    fwd_gemm_f = sum(2 * x * y * z for x, y, z in gemms)
    attention = [_attention(model_cfg, layout, impl, hw, i) for i in blocks]  # (forward s, backward s, their FLOPs)
    block_traffic = _block_traffic_per_token(d, f, tp, sigma, impl) * n
    bias_sums = _matmul_bytes(impl) * n * (3 * d + f) / tp / bandwidth
    forward = len(blocks) * (fwd_gemm_t + block_traffic / bandwidth) + sum(a[0] for a in attention)
    weight_grad = len(blocks) * (fwd_gemm_t + bias_sums)
    input_grad = len(blocks) * (fwd_gemm_t + 2 * block_traffic / bandwidth - bias_sums)
    input_grad += sum(a[1] for a in attention)
    # a block's copies of the scattered operands into sequence-major pieces (parallel/overlap.py's _pieces), read and
    # written: the row layers' x (rows × k) in the forward, again where the block is recomputed, the column layers'
    # g (rows × m) in the input gradient; in float8 counted with the casts (ring_fp8_cast_bytes)
    copy_forward = copy_backward = 0.0
    for name, (rows, k, m) in zip(BLOCK_LINEARS, gemms):
        if copied and name not in in_fp8:
            if name in COLUMN_PARALLEL:
                copy_backward += 2 * _matmul_bytes(impl) * rows * m / bandwidth
            else:
                copy_forward += 2 * _matmul_bytes(impl) * rows * k / bandwidth
    forward += len(blocks) * copy_forward
    input_grad += len(blocks) * copy_backward
    per_block = max(len(blocks), 1)  # a recomputed block's attention forward: the blocks' mean
    input_grad += recomputed * (fwd_gemm_t + block_traffic / bandwidth + copy_forward
                                + sum(a[0] for a in attention) / per_block)
    kernels = impl.kernels_per_block * (len(blocks) + 0.35 * recomputed)
    if layout.selective_recompute:
        kept = len(blocks) - recomputed
        input_grad += kept * _selective_recompute_per_token(d, f, tp, layout.sequence_parallel, impl) * n / bandwidth
        kernels += SELECTIVE_KERNELS * kept
    if ring and impl.ring_launches:  # the ring layers run eager, compiled blocks or not
        added = (RING_LAUNCHES[name in in_fp8, name in COLUMN_PARALLEL] for name in BLOCK_LINEARS)
        weight_casts = len(in_fp8) * RING_WEIGHT_CAST_LAUNCHES / layout.micro_batches  # a step's first micro batch
        no_copy = 0 if copied else len(BLOCK_LINEARS) * RING_COPY_LAUNCHES
        kernels += len(blocks) * (sum(a + b * tp for a, b in added) + weight_casts - no_copy)
    if impl.fp8 is not None:
        if not impl.compiled and not (ring and impl.ring_launches):
            kernels += len(in_fp8) * FP8_KERNELS_PER_LINEAR[impl.fp8] * (len(blocks) + recomputed)
        if tp > 1:
            column, row = RING_FP8_AMAX_REDUCTIONS if ring else FP8_AMAX_REDUCTIONS[impl.fp8]
            reductions = sum(column if name in COLUMN_PARALLEL else row for name in in_fp8)
            input_grad += len(blocks) * reductions * COLLECTIVE_LATENCY_S
    flops = len(blocks) * 3 * fwd_gemm_f + sum(a[2] + a[3] for a in attention)
    flops += recomputed * (fwd_gemm_f + sum(a[2] for a in attention) / per_block)
    return Passes(forward, input_grad, weight_grad), flops, kernels


# Bytes a score element of a materialized attention (Implementation.materialized_attention) moves through the
# elementwise kernels between its products, in 2-byte scores: forward, the softmax (read S, write P: 4) and the
# attention dropout (read P, write P' and its 1-byte mask: 5); backward, the dropout's (read dP' and the mask, write
# dP: 5) and the softmax's (read P and dP, write dS: 6)
MATERIALIZED_SCORE_BYTES = (4 + 5, 5 + 6)


def scattered_copies(layout: Layout, impl: Implementation) -> bool:
    """Whether the ring copies the operand it scatters into sequence-major pieces (parallel/overlap.py's _pieces):
    with (B, T, d) activations and several sequences a micro batch, where a sequence piece is strided; not where
    the activations are laid out sequence first (Implementation.sequence_first: Megatron's (T, B, d))."""
    return layout.micro_batch > 1 and not impl.sequence_first


def _attention(model_cfg: GPTConfig, layout: Layout, impl: Implementation, hw: Hardware,
               block: int) -> tuple[float, float, float, float]:
    """(forward s, backward s, forward FLOPs, backward FLOPs) of block `block`'s attention core on a rank, one micro
    batch. The fused kernel (gpt3d's): QKᵀ and PV over the visible query-key pairs, 4·n·(d/p)·keys FLOPs forward
    and 2.5 times that backward, at `attention_efficiency` of peak. Materialized (Megatron-LM before fused attention
    kernels): each of the heads/p heads' T × T scores written out, so QKᵀ and PV (forward) and the backward's four
    products (dP', dV, dQ, dK) are batched GEMMs over all T² pairs (the causal mask applied in the softmax), each
    2·T²·d_head FLOPs a head, at the GEMM rate or its bytes (the scores in 2 bytes, two (T, d_head) operands), and
    the softmax and dropout between them move MATERIALIZED_SCORE_BYTES a score (the softmax over the whole square)."""
    if not impl.materialized_attention:
        n = layout.micro_batch * model_cfg.seq_len
        flops = 4 * n * model_cfg.d_model / layout.tp * _visible_keys(model_cfg, block)
        rate = hw.peak_tflops * 1e12 * impl.attention_efficiency
        return flops / rate, 2.5 * flops / rate, flops, 2.5 * flops
    t, heads = model_cfg.seq_len, layout.micro_batch * model_cfg.n_head // layout.tp
    head_dim = model_cfg.d_model // model_cfg.n_head
    scores, product_flops = heads * t * t, 2 * heads * t * t * head_dim
    product = max(product_flops / hw.flops, (2 * scores + 2 * 2 * heads * t * head_dim) / hw.memory_bandwidth)
    elementwise = [b * scores / hw.memory_bandwidth for b in MATERIALIZED_SCORE_BYTES]
    return 2 * product + elementwise[0], 4 * product + elementwise[1], 2 * product_flops, 4 * product_flops


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


@lru_cache(maxsize=4096)
def _stage_compute(model_cfg: GPTConfig, layout: Layout, impl: Implementation, hw: Hardware, stage: int,
                   shape: StageShape, drop_tied: bool = False) -> tuple[Passes, float]:
    """(seconds by pass, hardware FLOPs) of one micro batch's forward + backward (+ recompute) on virtual stage
    `stage` of the layout (a rank's whole stage, or one of its chunks; drop_tied: the rank also holds the
    embedding, so the head's tied matrix is that one, counted there).
    Beyond the blocks (_blocks_compute): the weights' traffic in B; the head's three unembedding products
    and its loss traffic, all in F with the fused loss (it makes both gradients in its forward), else one
    product and half the traffic in F; the embedding's traffic, half in F; under DeepSpeed's BF16_Optimizer
    each gradient's addition to its fp32 copy (BF16_OPTIMIZER_UPDATE_BYTES, a
    kernel a parameter); under gpt3d's own pipeline schedules (zb-h1, interleaved, zb-v: ScheduleEngine) every
    bf16 gradient is written fresh, nothing cleared or accumulated (parallel/schedules/engine.py drops them
    once added), the addition in W for the parameters W computes (the block linears' weights and the column
    layers' biases) and in B for the rest."""
    tp, d, n = layout.tp, model_cfg.d_model, layout.micro_batch * model_cfg.seq_len
    a, bandwidth = _matmul_bytes(impl), hw.memory_bandwidth
    split = layout.placement.stages, layout.stage_layers
    blocks = list(stage_blocks(model_cfg.n_layer, split[0], stage, split[1]))
    recomputed = checkpointed_blocks(shape, layout.checkpoint_every)
    passes, flops, host_kernels = _blocks_compute(model_cfg, layout, impl, hw, blocks, recomputed)
    forward, input_grad, weight_grad = passes.forward, passes.input_grad, passes.weight_grad
    params = [p for p in rank_parameters(model_cfg, tp, split[0], stage, split[1])
              if not (drop_tied and shape.head and p.tied)]
    weights = sum(p.numel for p in params)
    bf16_optimizer = uses_bf16_optimizer(layout.zero_stage, impl)
    per_weight = _per_weight_bytes(impl) + (BF16_OPTIMIZER_UPDATE_BYTES if bf16_optimizer else 0)
    if bf16_optimizer:
        host_kernels += len(params)  # the update's add, a parameter at a time
    if layout.own_engine and bf16_optimizer:  # fresh bf16 gradients every pass, each added to its fp32 one
        deferred = len(blocks) * deferred_parameters_per_block(model_cfg, tp) if layout.defers_weight_grads else 0
        input_grad += (weights - deferred) * BF16_OPTIMIZER_UPDATE_BYTES / bandwidth  # in B (nothing cleared or +=)
        weight_grad += deferred * BF16_OPTIMIZER_UPDATE_BYTES / bandwidth  # W's parameters, in W
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


@lru_cache(maxsize=4096)
def _sizes(params: tuple) -> tuple[int, int]:
    """(elements, elements in the weight-decay group) of a rank's parameters."""
    return sum(p.numel for p in params), sum(p.numel for p in params if p.decay)


def _memory(layout: Layout, impl: Implementation, params, state: StateBytes, acts: ActivationBytes,
            held: tuple[int, int, int], reduce_bucket: int, weight_casts: int = 0,
            bf16_grads: tuple[int, int] = (0, 0)) -> dict:
    """Bytes by kind at the rank's peak: the larger of the backward phase (`held`: the activations and weight
    copies of the micro batches in flight and the deferred W passes' inputs, at their peak; gradients as they
    accumulate) and the optimizer step (gradients as ZeRO hands them over, AdamW's foreach temporaries,
    DeepSpeed's flattened buffers); in both the float8 weight casts kept through the step (`weight_casts`) and
    BF16_Optimizer's bf16 gradients alive then (`bf16_grads`: backward, step; `bf16_gradient_bytes`)."""
    dp, zero = layout.dp, layout.zero_stage
    n_local, decayed = _sizes(params)
    common = {"weights": state.weights, "master": state.master, "moments": state.moments, "buffers": state.buffers}
    if weight_casts:
        common["float8_weight_casts"] = weight_casts
    g = 2 if impl.bf16_weights else FP32  # a gradient element
    bf16_optimizer = uses_bf16_optimizer(zero, impl)  # its gradients are all there from the start
    grads_backward = {0: state.gradients, 1: state.gradients if bf16_optimizer else g * n_local,
                      2: state.gradients + g * min(reduce_bucket, n_local),
                      3: state.gradients}[zero] + bf16_grads[0]
    activations, copies, deferred = held
    backward = {**common, "gradients": grads_backward, "activations": activations,
                "weight_copies": copies, "deferred_weight_grads": deferred,
                "transient": max(acts.recompute, acts.cast_transient - acts.weight_copies, acts.loss_transient)}
    largest_group = max(decayed, n_local - decayed)
    partitioned = zero > 0 or bf16_optimizer
    step_extra = FP32 * (state.partition if partitioned else largest_group)  # foreach sqrt of the second moment
    if zero_optimizer_reduces(zero, impl) and zero < 3:
        step_extra += FP32 * state.partition  # the flattened fp32 gradient partition
    if zero == 0 and dp > 1:
        step_extra += FP32 * min(REDUCE_BUCKET_SIZE, n_local)  # the flattened all-reduce bucket
    step = {**common, "gradients": state.gradients + bf16_grads[1], "optimizer_transient": step_extra}
    return backward if sum(backward.values()) >= sum(step.values()) else step


def _stage_ranks(model_cfg: GPTConfig, layout: Layout, impl: Implementation, hw: Hardware, stages: list[int],
                 inter_node: dict, order_costs: Costs | None = None) -> list[RankPlan]:
    """The RankPlans of pipeline ranks `stages`, which hold alike chunks (`_rank_key`): their state, activations,
    communication and time are one rank's, computed once from its chunks (its virtual stages, one under 1f1b
    and zb-h1); what each holds at its peak depends on the rank (held_at_peak, chunks_held_at_peak).
    order_costs: the F, B and W shares zb-v's engine orders every rank's passes by (RunSpec.pass_costs: the
    plan's slowest rank's); None: these ranks' own."""
    tp, pp, dp, m = layout.tp, layout.pp, layout.dp, layout.micro_batches
    placement, spec = layout.placement, layout.stage_layers
    stage, virtual = stages[0], placement.stages
    chunks = placement.stages_of(stage)
    holds_both = virtual > 1 and 0 in chunks and virtual - 1 in chunks  # zb-v's first rank: one tied matrix
    chunk_params = [rank_parameters(model_cfg, tp, virtual, v, spec) for v in chunks]
    params = chunked_rank_parameters(model_cfg, tp, placement, stage, spec)
    chunk_shapes = [StageShape.of(model_cfg, virtual, v, spec) for v in chunks]
    shape = StageShape(any(c.embedding for c in chunk_shapes), sum(c.blocks for c in chunk_shapes),
                       any(c.head for c in chunk_shapes), pp > 1)  # the rank's layers together
    bf16_weights, r = impl.bf16_weights, _residual_bytes(impl)
    comm_dtypes = (FP32, 2) if impl.autocast and tp == 1 else (FP32,)
    bucket = bucket_elements(model_cfg, tp)  # what train/planner/zero_buckets.py sets
    state = state_bytes(params, layout.zero_stage, dp, 0, layout.offload_optimizer, comm_dtypes,
                        bf16_weights=bf16_weights, reduce_bucket_size=bucket)
    chunk_acts = [_chunk_activations(model_cfg, layout, impl, hw, _alike_stage(model_cfg, layout, v)) for v in chunks]
    acts = _through_all(chunk_acts)
    a = _matmul_bytes(impl)
    ring8 = ring_float8(model_cfg, layout, impl, hw)
    chunk_deferred = [deferred_weight_grad_bytes(model_cfg, tp, virtual, v, layout.micro_batch, a, spec, ring8)
                      if layout.defers_weight_grads else 0 for v in chunks]
    deferred_bytes = sum(chunk_deferred)
    weight_casts = kept_weight_cast_bytes(model_cfg, tp, shape.blocks, ring8)

    grad_bytes = partial(dp_grad_bytes, impl, layout.zero_stage)
    transfers = (
        plan_comm.tensor_parallel(model_cfg, shape, tp, layout.micro_batch, m, sequence_parallel=layout.sequence_parallel,
                                  autocast=impl.autocast, residual_bytes=r, fused_loss=impl.fused_loss,
                                  ring=ring_runs(layout, impl),
                                  float8_linears=linears_at(model_cfg, layout, impl, hw))
        + _pipeline_transfers(model_cfg, layout, stage, chunk_params, chunk_shapes, r)
        # bf16 at ZeRO 0: BF16_Optimizer partitions the optimizer and so, like ZeRO 1, all-gathers the
        # updated weights after its step
        + plan_comm.data_parallel(params, dp, 1 if bf16_weights and layout.zero_stage == 0 else layout.zero_stage,
                                  m, flat_elements=state.details.get("flat", 0),
                                  grad_bytes=grad_bytes, weight_bytes=FP32 if impl.fp32_weights else 2)
    )
    computed = [_stage_compute(model_cfg, layout, impl, hw, _alike_stage(model_cfg, layout, v), c, holds_both)
                for v, c in zip(chunks, chunk_shapes)]
    passes, flops = sum((p for p, _ in computed), Passes(0.0, 0.0, 0.0)), sum(f for _, f in computed)
    optimizer_s = 0.0 if layout.offload_optimizer else OPTIMIZER_BYTES * (
        sum(p.numel for p in params) if layout.zero_stage == 0 else state.partition) / hw.memory_bandwidth
    if launch_priced(layout, impl):  # one GPU: the step launch by launch, as the step bill prices it
        step, update = one_gpu_step(model_cfg, layout.micro_batch, m, impl.precision, hw, impl.fused_loss,
                                    layout.checkpoint_every, layout.selective_recompute)
        passes, optimizer_s = passes.scaled_to((step.seconds - update.device_busy) / m), update.device_busy
    compute_s = passes.total
    tp_transfers = [t for t in transfers if t.group == "tp"]
    # under zb-h1 and zb-v the weight-gradient GEMM is deferred to W: nothing runs beside the input-gradient all-reduce
    overlap_tp = impl.overlap_tp and not layout.defers_weight_grads
    overlapped = [t for t in tp_transfers if overlap_tp and t.overlaps == plan_comm.WEIGHT_GRADIENT]
    ringed = [t for t in tp_transfers if t.overlaps == plan_comm.RING]
    tp_s = _comm_time([t for t in tp_transfers if t not in overlapped and t not in ringed], hw, inter_node) / m
    tp_s += _exposed_behind_weight_gradients(model_cfg, layout, impl, hw, overlapped, inter_node) / m
    tp_s += _exposed_in_ring_steps(model_cfg, layout, impl, hw, ringed, inter_node) / m
    sends = [t for t in transfers if t.group == "pp" and t.op == "send"]
    if layout.own_engine:  # asynchronous sends, their receives posted ahead: exposed past the chunk's next pass
        beside = {"forward": passes.forward / len(chunks), "backward": passes.input_grad / len(chunks)}
        send_s = {id(t): t.count * max(0.0, _comm_time([t], hw, inter_node) / t.count - beside[t.phase]) for t in sends}
    else:  # DeepSpeed's 1F1B sends and waits
        send_s = {id(t): _comm_time([t], hw, inter_node) for t in sends}
    pp_s = sum(send_s.values()) / m
    gathers = [t for t in transfers if t.group == "dp" and t.phase == "forward"]
    gather_s = _comm_time(gathers, hw, inter_node) / m
    forward_comm_s = gather_s + (_comm_time([t for t in tp_transfers if t.phase == "forward"], hw, inter_node)
                                 + sum(send_s[id(t)] for t in sends if t.phase == "forward")) / m
    exposed = [t for t in transfers if t not in gathers and (t.group == "dp" or (t.group == "pp" and t.op != "send"))]
    overlap_dp = impl.overlap_dp and pp == 1 and zero_optimizer_reduces(layout.zero_stage, impl)
    hidden = [t for t in exposed if overlap_dp and t.overlaps == plan_comm.BACKWARD]
    backward_s = 2 / 3 * compute_s  # one micro batch's backward (module docstring)
    dp_s = _comm_time([t for t in exposed if t not in hidden], hw, inter_node)
    if impl.chunked_dp_overlap:  # the last chunk's reduction and the first chunk's gather stay on the path
        dp_group = [t for t in exposed if t not in hidden and t.group == "dp"]
        dp_s -= (1 - 1 / placement.virtual) * _comm_time(dp_group, hw, inter_node)
    elif chunk_reductions_run(layout, impl):  # each chunk's reduction after its last B, but chunk 0's (the last to finish)
        reduction = [t for t in exposed if t.group == "dp" and t.op == "all_reduce"]
        early = [sum(p.numel * grad_bytes(p) for p in c if not p.tied) for c in chunk_params]
        dp_s -= _comm_time(reduction, hw, inter_node) - _exposed_chunk_reductions(
            early, reduction[0].total, pp * passes.input_grad / len(chunks), dp, hw, inter_node)
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
        if placement.virtual == 1:
            in_flight, deferred = held_at_peak(layout.schedule, pp, m, s, acts.saved, deferred_bytes)
            retained = 0  # DeepSpeed's 1F1B: the last stage's inputs that its kept losses hold (activations.py)
            if layout.schedule == ONE_F_ONE_B and pp > 1 and s == pp - 1:
                retained = min(2, m - 1) * received_activation_bytes(model_cfg, tp, layout.sequence_parallel,
                                                                     layout.micro_batch, r)
            held = (in_flight * acts.activations + retained, in_flight * acts.weight_copies, deferred * deferred_bytes)
        else:  # this rank's own virtual stages, alike to the first rank's chunk by chunk
            own = placement.stages_of(s)
            saved = {v: (x.activations, x.weight_copies) for v, x in zip(own, chunk_acts)}
            (activations, copies), w_bytes, in_flight, deferred = chunks_held_at_peak(
                layout.schedule, placement, m, s, saved, dict(zip(own, chunk_deferred)) if deferred_bytes else {},
                order_costs or Costs(*passes.shares()))
            held = (activations, copies, w_bytes)
        memory = _memory(layout, impl, params, state, acts, held, bucket, weight_casts,
                         bf16_gradient_bytes(layout, impl, params, chunk_params))
        ranks.append(RankPlan(s, parameters, state, acts, in_flight, deferred, deferred_bytes, held, memory,
                              sum(memory.values()), flops * m, transfers, time, placement.stages_of(s),
                              tuple(p.total for p, _ in computed)))
    return ranks


@lru_cache(maxsize=4096)
def _alike_stage(model_cfg: GPTConfig, layout: Layout, stage: int) -> int:
    """The first virtual stage whose chunk computes and saves what `stage`'s does (the same layers' kinds and
    count, its first block of the same attention parity), for the caches of `_stage_compute` and
    `_chunk_activations`: a rank of 6 chunks, or 16 ranks alike, cost one computation."""
    placement, spec = layout.placement, layout.stage_layers

    def key(v: int) -> tuple:
        blocks = stage_blocks(model_cfg.n_layer, placement.stages, v, spec)
        return StageShape.of(model_cfg, placement.stages, v, spec), len(blocks), blocks.start % 2

    return next(v for v in range(stage + 1) if key(v) == key(stage))


@lru_cache(maxsize=4096)
def _chunk_activations(model_cfg: GPTConfig, layout: Layout, impl: Implementation, hw: Hardware,
                       stage: int) -> ActivationBytes:
    """Activation bytes of one micro batch on virtual stage `stage` (activations.micro_batch_activations)."""
    return micro_batch_activations(
        model_cfg, layout.tp, layout.placement.stages, stage, layout.micro_batch,
        sequence_parallel=layout.sequence_parallel, checkpoint_every=layout.checkpoint_every, autocast=impl.autocast,
        bf16_weights=impl.bf16_weights, selective=layout.selective_recompute, fused_loss=impl.fused_loss,
        blocks=layout.stage_layers, ring_float8=ring_float8(model_cfg, layout, impl, hw))


def kept_weight_cast_bytes(model_cfg: GPTConfig, tp: int, blocks: int, ring_float8: tuple) -> int:
    """Bytes of the float8 weight casts a rank keeps through a step (model/float8_weights.py): both layouts, a byte
    an element, of the weights of its `blocks` blocks' linears in `ring_float8` (parallel/ring_operands.py keeps
    them; (k, m) of each weight on a tensor-parallel rank)."""
    shapes = linear_shapes(model_cfg, tp)
    return 2 * blocks * sum(shapes[name][0] * shapes[name][1] for name in ring_float8)


def ring_float8(model_cfg: GPTConfig, layout: Layout, impl: Implementation, hw: Hardware) -> tuple[str, ...]:
    """The block linears whose operands the ring overlap quantizes (parallel/ring_operands.py): those in float8
    when the ring runs (parallel.tp_comm_overlap under sequence parallelism, tp > 1), else none."""
    return linears_at(model_cfg, layout, impl, hw) if ring_runs(layout, impl) else ()


def ring_runs(layout: Layout, impl: Implementation) -> bool:
    """Whether the block linears run their collectives in ring steps: parallel.tp_comm_overlap under sequence
    parallelism, tp > 1."""
    return impl.ring_tp and layout.sequence_parallel and layout.tp > 1


def _through_all(chunk_acts: list[ActivationBytes]) -> ActivationBytes:
    """One micro batch through all of a rank's chunks: what each saves, added; what is transient, the largest."""
    if len(chunk_acts) == 1:
        return chunk_acts[0]
    return ActivationBytes(sum(x.saved for x in chunk_acts), sum(x.weight_copies for x in chunk_acts),
                           max(x.recompute for x in chunk_acts), max(x.per_block for x in chunk_acts),
                           max(x.cast_transient for x in chunk_acts), max(x.loss_transient for x in chunk_acts))


def _pipeline_transfers(model_cfg: GPTConfig, layout: Layout, rank: int, chunk_params, chunk_shapes, r: int) -> list:
    """The pipeline traffic of a rank's chunks (plan_comm.pipeline of each, as a stage of the virtual pipeline),
    less what stays on the rank: a message between two of its own consecutive stages (the turn of zb-v's V)
    and the tied matrix's all-reduce where it holds both copies' layers."""
    placement = layout.placement
    chunks = placement.stages_of(rank)
    holds_both = placement.stages > 1 and 0 in chunks and placement.stages - 1 in chunks
    out = []
    for v, params, shape in zip(chunks, chunk_params, chunk_shapes):
        tied = sum(p.numel for p in params if p.tied)
        local_next = v + 1 < placement.stages and placement.rank_of(v + 1) == rank
        local_previous = v > 0 and placement.rank_of(v - 1) == rank
        for t in plan_comm.pipeline(model_cfg, shape, layout.tp, placement.stages, layout.micro_batch,
                                    layout.micro_batches, tied, sequence_parallel=layout.sequence_parallel,
                                    residual_bytes=r):
            stays = ((t.op == "send" and t.phase == "forward" and local_next)
                     or (t.op == "send" and t.phase == "backward" and local_previous)
                     or (t.op == "all_reduce" and holds_both))
            if not stays:
                out.append(t)
    return out


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


def bf16_gradient_bytes(layout: Layout, impl: Implementation, params, chunk_params) -> tuple[int, int]:
    """Bytes of the bf16 gradients autograd writes that are alive under BF16_Optimizer (bf16 weights, ZeRO ≤ 1)
    at the backward's peak and at the optimizer step, beside its fp32 accumulation buffer: with one pipeline
    stage DeepSpeed adds each to its fp32 one as backward makes it and drops it (bf16.immediate_grad_update,
    train/run/engine.py): one parameter's, none at the step; gpt3d's own schedules drop them after each B (and
    W) pass (parallel/schedules/engine.py): one chunk's, none at the step; DeepSpeed's 1F1B keeps and accumulates
    them until the step: all of them. (0, 0) without BF16_Optimizer."""
    if not uses_bf16_optimizer(layout.zero_stage, impl):
        return 0, 0
    if layout.pp == 1:
        return 2 * max(p.numel for p in params), 0
    if layout.own_engine:
        return 2 * max(sum(p.numel for p in chunk) for chunk in chunk_params), 0
    every = 2 * sum(p.numel for p in params)
    return every, every


def dp_grad_bytes(impl: Implementation, zero_stage: int, param) -> int:
    """Bytes an element of `param`'s gradient is reduced in over the data-parallel group: `grad_reduce_bytes` when
    set; with bf16 weights 2 (BF16_Optimizer, ZeRO ≤ 1, casts its fp32 gradients to DeepSpeed's communication
    dtype, bf16 under bf16, before the all-reduce; ZeRO 2 and 3 reduce the bf16 gradients); otherwise fp32, but
    under autocast ZeRO ≥ 1 reduces plain nn.Linear gradients in bf16."""
    if impl.grad_reduce_bytes is not None:
        return impl.grad_reduce_bytes
    if impl.bf16_weights:
        return 2
    return 2 if impl.autocast and param.linear and zero_stage > 0 else FP32


def chunk_reductions_run(layout: Layout, impl: Implementation) -> bool:
    """gpt3d's engine issues each chunk's data-parallel gradient reduction after its last B
    (parallel/schedules/grad_reduction.py): under the interleaved schedule (several chunks, W not split off) with
    DeepSpeed's BF16_Optimizer and other data-parallel ranks, parallel.overlap_communication on."""
    bf16_optimizer = uses_bf16_optimizer(layout.zero_stage, impl) and not layout.offload_optimizer
    return impl.chunked_grad_reduction and layout.pp > 1 and reduces_chunks(layout.schedule, layout.virtual_stages,
                                                                             bf16_optimizer, layout.dp)


def _exposed_chunk_reductions(early: list[float], total: float, window_s: float, dp: int, hw: Hardware,
                              inter_node: dict) -> float:
    """Seconds of a rank's gradient reduction left on the step's path when its chunks c = V − 1, …, 1 (bytes
    early[c], the tied embedding left out) are reduced as each finishes its last B and the rest (chunk 0's, the
    tied embedding's: total − Σ early[1:]) at the step's end. Chunk c finishes a window after chunk c + 1 (the pp
    B passes of chunk c's last micro batches: window_s); issuing one waits for the one before it (the engine
    holds two buffers at most), so a reduction longer than its window delays the backward by the difference,
    and what the last early one has left when the backward ends is exposed, with the rest (counted as one call;
    a rank holding the tied embedding makes two, chunk 0's and the tied one's)."""
    def seconds(nbytes: float) -> float:
        return _comm_time([plan_comm.Transfer("dp", "all_reduce", "step", nbytes, 1, dp, "gradients")], hw, inter_node)

    issued_at, done_at, delay_so_far = 0.0, 0.0, 0.0
    for k, nbytes in enumerate(reversed(early[1:])):  # chunk V − 1 first
        issued_at = max(k * window_s + delay_so_far, done_at)
        delay_so_far = issued_at - k * window_s
        done_at = issued_at + seconds(nbytes)
    backward_end = (len(early) - 1) * window_s + delay_so_far
    return delay_so_far + max(0.0, done_at - backward_end) + seconds(total - sum(early[1:]))


def _exposed_in_ring_steps(model_cfg: GPTConfig, layout: Layout, impl: Implementation, hw: Hardware,
                           transfers, inter_node: dict) -> float:
    """Seconds per step of the ring-decomposed collectives (parallel.tp_comm_overlap) that their GEMMs do not
    hide. A collective of a tensor of b bytes runs as p − 1 exchanges of b/p bytes (each at the link's bandwidth
    plus the collective latency), each behind one of the layer's GEMM chunks of G/p (the GEMM G split along the
    sequence; in float8 the product alone, its operands cast before the ring), which runs
    `Implementation.ring_gemm_slowdown` slower beside it: the layer takes G/p + (p − 1)·max(exchange, (1 + s)·G/p),
    so the exposed part is (p − 1)·(max(exchange, (1 + s)·G/p) − G/p). One transfer per block linear."""
    p, n, bandwidth = layout.tp, layout.micro_batch * model_cfg.seq_len, hw.link_bandwidth(inter_node["tp"])
    in_fp8, shapes = linears_at(model_cfg, layout, impl, hw), linear_shapes(model_cfg, p)
    exposed = 0.0
    for t in transfers:  # count: one per block and micro batch
        exchange = t.nbytes / p / bandwidth + COLLECTIVE_LATENCY_S
        k, m = shapes[t.linear]  # the GEMM (n × k)·(k × m) it hides behind: the linear's forward,
        if t.phase == "backward":  # or its input gradient's (n × m)·(m × k)
            k, m = m, k
        gemm = _fp8_gemm_time(hw, n, k, m) if t.linear in in_fp8 else _gemm_time(hw, impl, n, k, m, _matmul_bytes(impl))
        slower = 1 + impl.ring_gemm_slowdown
        exposed += t.count * (p - 1) * (max(exchange, slower * gemm / p) - gemm / p)
    return exposed


def build_plan(
    model_cfg: GPTConfig, layout: Layout, hardware: Hardware, *, implementation: Implementation = Implementation(),
    gpus_per_node: int = 8, reserved_gib: float = 0.0, tokens: float = 300e9,
) -> Plan:
    """The prediction for `layout` (see module docstring); ranks: first, middle and last stage."""
    tp, dp, m = layout.tp, layout.dp, layout.micro_batches
    inter_node = {"tp": tp > gpus_per_node, "pp": tp * dp >= gpus_per_node, "dp": tp * dp > gpus_per_node}
    alike = {}  # ranks with alike chunks predict the same time: each kind computed once
    for s in range(layout.pp):
        alike.setdefault(_rank_key(model_cfg, layout, s), []).append(s)
    def ranks(order_costs: Costs | None = None) -> list[RankPlan]:
        return sorted((rank for members in alike.values() for rank in _stage_ranks(
            model_cfg, layout, implementation, hardware, members, inter_node, order_costs)), key=lambda rank: rank.stage)

    stages = ranks()
    slowest = max(stages, key=lambda r: r.time["micro_batch_s"])
    if layout.schedule == ZB_V:  # the memory of the order the engine runs: by the slowest rank's shares
        stages = ranks(Costs(*slowest.passes.shares()))
    pipeline = PipelineTime(m, slowest, pipeline_seconds(layout.schedule, layout.placement, m, slowest.passes))
    step_s = pipeline.seconds + max(r.time["dp_comm_s"] + r.time["optimizer_s"] for r in stages)
    shown = sorted({0, layout.pp // 2, layout.pp - 1})
    return Plan(
        model=model_cfg, layout=layout, hardware=hardware, implementation=implementation,
        ranks=[stages[s] for s in shown], pipeline=pipeline, step_time_s=step_s,
        model_flops_per_step=model_flops_per_token(model_cfg) * layout.global_batch * model_cfg.seq_len,
        hardware_flops_per_step=sum(r.hardware_flops for r in stages) * tp * dp,
        reserved_gib=reserved_gib, tokens=tokens, gpus_per_node=gpus_per_node, notes=_notes(layout),
        stage_seconds=tuple(seconds for _, seconds in sorted(
            (v, t) for rank in stages for v, t in zip(rank.chunks, rank.chunk_seconds))),
    )


@lru_cache(maxsize=8192)
def _rank_key(model_cfg: GPTConfig, layout: Layout, rank: int) -> tuple:
    """What a rank's time and state depend on, chunk by chunk: each chunk's layers (kind, block count, the
    parity of its first block: GPT-3 alternates dense and banded attention) and which of its neighbours are
    on the rank itself."""
    placement, spec = layout.placement, layout.stage_layers
    key = []
    for v in placement.stages_of(rank):
        blocks = stage_blocks(model_cfg.n_layer, placement.stages, v, spec)
        key.append((StageShape.of(model_cfg, placement.stages, v, spec), len(blocks), blocks.start % 2,
                    v > 0 and placement.rank_of(v - 1) == rank,
                    v + 1 < placement.stages and placement.rank_of(v + 1) == rank))
    return tuple(key)


def _notes(layout: Layout) -> list[str]:
    notes = []
    if layout.offload_optimizer:
        notes.append("optimizer offload: the CPU optimizer's time and the host transfers are not modelled")
    return notes
