"""What one rank of a layout holds: its parameters, and the bytes of its weights, gradients, fp32
master weights and Adam moments, counted the way the built system allocates them.

Parameters. parallel/build.py builds a rank's part from the flat layer list [Embedding, Block_0 …
Block_{L-1}, Head]: all of it when pp = 1 (a GPT, whose unembedding *is* the token embedding, one
Parameter), else the layers `parallel.pipeline.stage_bounds` puts on the rank's stage (the last
stage holds its own copy of the tied matrix, as the Head's lm_head.weight). Each layer's parameters
and their local shapes under tensor parallelism come from the naming API (`parallel.naming.
layer_shards`), which names every parameter as the full model does: the last stage's tied copy is
"layers.0.wte.weight" too.

Bytes (DeepSpeed 0.19 with the fp32 parameters gpt3d trains, Adam with two fp32 moments):

  ZeRO 0   weights 4N, gradients 4N, moments 8N; no separate master copy (the weights are fp32).
  ZeRO 1,2 each optimizer group (matrices with decay, vectors without) is flattened and padded to a
           multiple of 2·dp elements: weights 4·flat. Rank r
           owns partition r (flat/dp elements) and keeps an fp32 clone of it (master), its two moments,
           and at the step a gradient buffer holding every parameter that overlaps its partition (the last
           rank also the padding).
  ZeRO 3   every parameter is padded to a multiple of dp and cut into dp pieces: weights = the pieces
           plus full (padded) copies of "persistent" parameters (≤ 1e5 elements); gradients, master and
           moments = one piece each. Fixed buffers: a gradient reduce bucket (reduce_bucket_size,
           DeepSpeed's default 5e8 elements) per communication dtype (allocated up front), `buffers`.

With optimizer offload the master weights and moments live in host memory (`host`).

With bf16 weights (train.precision=bf16, train/runtime/precision.py: DeepSpeed's "bf16": {"enabled": true};
at zero_stage 0 and 1 DeepSpeed runs stage 1 with data_types.grad_accum_dtype fp32, which
engine._do_optimizer_sanity_check hands to BF16_Optimizer) the weights take 2 bytes and an fp32
master copy appears:

  ZeRO 0, 1   BF16_Optimizer (bf16_optimizer.py): each group flattened and padded as ZeRO 1's;
              weights 2·flat; gradients: the flat fp32 accumulation buffer (4·flat); fp32 master and
              moments of partition r only (4 and 8 bytes · flat/dp). The bf16 gradients autograd writes
              are not state: how long they live depends on the engine (train/planner/estimate.py,
              `bf16_gradient_bytes`).
  ZeRO 2      DeepSpeed's ZeRO optimizer, gradients accumulated in bf16: weights 2·flat, gradients
              2 bytes of each parameter overlapping the partition, master 4·flat/dp, moments 8·flat/dp.
  ZeRO 3      pieces and persistent copies at 2 bytes, the gradient partition buffer in the
              accumulation dtype (2 bytes a piece), master and moments of the piece, one reduce
              bucket of bf16 elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache

import torch
from torch import nn

from model import GPTConfig
from model.gpt import make_layer
from parallel.naming import layer_shards
from parallel.tensor import TP_PLAN, plan_style

FP32 = 4
NCCL_START_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor
REDUCE_BUCKET_SIZE = 500_000_000  # DeepSpeed's default zero_optimization.reduce_bucket_size (elements)
PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default stage3_param_persistence_threshold (elements)


@dataclass(frozen=True)
class ParamShape:
    """One parameter as a rank holds it.

    name: the full model's parameter name ("layers.3.attn.qkv.weight"; the tied copy on the last
    pipeline stage: "layers.0.wte.weight"); shape: this rank's piece (vocabulary padding included);
    full_numel: the full parameter's elements (without padding); linear: it belongs to a plain
    nn.Linear (under autocast DeepSpeed reduces such gradients in bf16).
    """

    name: str
    shape: tuple[int, ...]
    full_numel: int
    linear: bool = False

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def decay(self) -> bool:
        """In the weight-decay group: matrices (train/optimizer.param_groups)."""
        return len(self.shape) >= 2

    @cached_property
    def tied(self) -> bool:
        """The token embedding, which the head shares (its copy on the last pipeline stage has the same name)."""
        return self.name.endswith("wte.weight")


@lru_cache(maxsize=None)
def stage_layers(n_layer: int, pp: int, stage: int, blocks: tuple[int, ...] | None = None) -> range:
    """Indices in the full layer list [Embedding, Block × n_layer, Head] of the layers on (virtual) `stage` of
    `pp`, where parallel/build.py puts them (all of them when pp = 1); `blocks`: the blocks of each stage
    (parallel.stage_layers), None for balanced by count."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} does not exist with pp={pp}")
    if pp == 1:
        return range(n_layer + 2)
    from parallel.pipeline import stage_bounds  # imports DeepSpeed's pipeline module

    bounds = stage_bounds(n_layer, pp, blocks)
    return range(bounds[stage], bounds[stage + 1])


def stage_blocks(n_layer: int, pp: int, stage: int, blocks: tuple[int, ...] | None = None) -> range:
    """Indices (0-based) of the transformer blocks on `stage`."""
    layers = stage_layers(n_layer, pp, stage, blocks)
    return range(max(layers.start, 1) - 1, min(layers.stop, n_layer + 1) - 1)


@lru_cache(maxsize=64)
def _plain_linear(config: GPTConfig, kind: int, tp: int) -> frozenset[str]:
    """Names of the parameters in layer `kind` (0 Embedding, 1 a Block, L + 1 Head) that belong to a
    plain nn.Linear once the layer is sharded: with tp > 1 the plan swaps every Linear it names."""
    with torch.device("meta"):
        layer = make_layer(config, kind)
    return frozenset(
        f"{owner}.{name}"
        for owner, module in layer.named_modules()
        if type(module) is nn.Linear and (tp == 1 or plan_style(TP_PLAN, f"layers.{kind}.{owner}") is None)
        for name, _ in module.named_parameters(recurse=False)
    )


@lru_cache(maxsize=4096)
def rank_parameters(config: GPTConfig, tp: int, pp: int, stage: int, blocks: tuple[int, ...] | None = None
                    ) -> tuple[ParamShape, ...]:
    """The parameters of a rank on pipeline stage `stage`, in the order its optimizer sees them, as
    parallel/build.py builds them (every tp rank of a stage holds the same shapes): the stage's layers
    in order, each layer's parameters in its own order; the tied copy dropped where its owner, the
    token embedding, is on the same rank (pp = 1: one Parameter). (pp, stage, blocks): as `stage_layers`."""
    layers = stage_layers(config.n_layer, pp, stage, blocks)
    params: list[ParamShape] = []
    for index in layers:
        linear = _plain_linear(config, index if index in (0, config.n_layer + 1) else 1, tp)
        for name, shard in layer_shards(config, index, tp).items():
            param = ParamShape(shard.name, shard.local_shape, math.prod(shard.full_shape), name in linear)
            if shard.tied and 0 in layers:  # the same Parameter as the embedding's: linear if either use is
                owner = next(i for i, p in enumerate(params) if p.name == shard.name)
                params[owner] = replace(params[owner], linear=params[owner].linear or param.linear)
            else:
                params.append(param)
    return tuple(params)


@lru_cache(maxsize=4096)
def chunked_rank_parameters(config: GPTConfig, tp: int, placement, rank: int,
                            blocks: tuple[int, ...] | None = None) -> tuple[ParamShape, ...]:
    """The parameters of pipeline rank `rank` holding the virtual stages `placement` (parallel/schedules/
    placement.py) gives it, chunk by chunk in order, as parallel/build.py builds them; where it holds both the
    embedding and the head (zb-v's first rank) the head's copy of the tied matrix is the embedding's Parameter."""
    chunks = [rank_parameters(config, tp, placement.stages, v, blocks) for v in placement.stages_of(rank)]
    params = [p for chunk in chunks for p in chunk]
    if len(chunks) > 1 and any(p.tied for p in chunks[0]):
        params = params[: len(chunks[0])] + [p for p in params[len(chunks[0]):] if not p.tied]
    return tuple(params)


@dataclass(frozen=True)
class StateBytes:
    """Bytes one rank keeps for its parameters and optimizer, by kind (see the module docstring)."""

    weights: int
    gradients: int
    master: int
    moments: int
    buffers: int = 0
    host: int = 0  # in host memory (optimizer offload), not on the device
    partition: int = 0  # elements of the parameters this rank updates (ZeRO ≥ 1), all groups
    details: dict = field(default_factory=dict, compare=False)

    @property
    def device_total(self) -> int:
        return self.weights + self.gradients + self.master + self.moments + self.buffers


def _groups(params: list[ParamShape]) -> list[list[ParamShape]]:
    """train/optimizer.param_groups: matrices (decay) first, then vectors; empty groups dropped."""
    return [g for g in ([p for p in params if p.decay], [p for p in params if not p.decay]) if g]


def _zero12(params: list[ParamShape], dp: int, dp_rank: int) -> tuple[int, int, int]:
    """(flat elements, partition elements, gradient elements at the step) summed over groups."""
    flat_total = partition_total = grad_total = 0
    for group in _groups(params):
        offsets, offset = [], 0
        for p in group:  # zero_optimization.parameter_alignment is off by default: no padding between
            offsets.append(offset)
            offset += p.numel
        flat = -(-offset // (NCCL_START_ALIGNMENT * dp)) * NCCL_START_ALIGNMENT * dp
        part = flat // dp
        lo, hi = dp_rank * part, (dp_rank + 1) * part
        mine = [p for p, start in zip(group, offsets) if start < hi and start + p.numel > lo]
        grad_total += sum(p.numel for p in mine)
        if dp_rank == dp - 1:
            grad_total += flat - offset  # the last partition's alignment padding, a zero tensor of its own
        flat_total, partition_total = flat_total + flat, partition_total + part
    return flat_total, partition_total, grad_total


def state_bytes(
    params: list[ParamShape], zero_stage: int, dp: int, dp_rank: int = 0, offload: bool = False,
    comm_dtype_bytes: tuple[int, ...] = (FP32,), bf16_weights: bool = False, reduce_bucket_size: int = REDUCE_BUCKET_SIZE,
) -> StateBytes:
    """The bytes a rank holding `params` keeps under ZeRO `zero_stage` over `dp` data-parallel ranks.

    comm_dtype_bytes: element sizes of the gradient-reduction dtypes (fp32; with autocast on a GPU
    and plain nn.Linear layers also bf16): ZeRO 3 keeps one reduce bucket per dtype.
    bf16_weights: bf16 parameters (module docstring).
    reduce_bucket_size: zero_optimization.reduce_bucket_size (elements).
    """
    n = sum(p.numel for p in params)
    width = 2 if bf16_weights else FP32  # bytes of a parameter the model computes with
    if zero_stage == 0 and not bf16_weights:  # the weights are the masters; nothing partitioned
        return StateBytes(weights=FP32 * n, gradients=FP32 * n, master=0, moments=2 * FP32 * n, partition=n)
    if zero_stage in (0, 1, 2):  # bf16 runs ZeRO 0 as DeepSpeed's bf16 optimizer, partitioned like ZeRO 1
        flat, part, grads = _zero12(params, dp, dp_rank)
        if not bf16_weights:
            gradients = FP32 * grads
        else:  # ZeRO 0/1: the fp32 accumulation buffer; ZeRO 2: bf16 partitions
            gradients = FP32 * flat if zero_stage < 2 else 2 * grads
        return _with_optimizer(width * flat, gradients, part, offload, details={"flat": flat})
    if zero_stage == 3:
        pieces = sum(-(-p.numel // dp) for p in params)
        # a persistent parameter stays gathered, in the padded buffer it was all-gathered into
        persistent = sum(-(-p.numel // dp) * dp for p in params if p.numel <= PERSISTENCE_THRESHOLD)
        buffers = reduce_bucket_size * (2 if bf16_weights else sum(comm_dtype_bytes))
        return _with_optimizer(width * (pieces + persistent), width * pieces, pieces, offload, buffers=buffers,
                               details={"persistent": persistent})
    raise ValueError(f"zero_stage={zero_stage!r}: must be one of [0, 1, 2, 3]")


def _with_optimizer(weights: int, gradients: int, partition: int, offload: bool, **extra) -> StateBytes:
    """StateBytes with the optimizer's fp32 master and two moments of `partition` elements, on the
    GPU or, offloaded, in host memory."""
    master, moments = FP32 * partition, 2 * FP32 * partition
    return StateBytes(weights=weights, gradients=gradients, master=0 if offload else master,
                      moments=0 if offload else moments, host=master + moments if offload else 0,
                      partition=partition, **extra)


def count_full_parameters(config: GPTConfig) -> int:
    """Parameters of the whole (unsharded, tied) model: what count_parameters(GPT(config)) gives."""
    return sum(p.full_numel for p in rank_parameters(config, 1, 1, 0))


def checkpoint_bytes(config: GPTConfig) -> int:
    """Bytes of the tensors one checkpoint holds, at any layout (train/checkpoint/saving.py): every full-model
    parameter's fp32 weights and its two fp32 Adam moments, the vocabulary unpadded; 12 bytes a parameter.
    Its JSON files and the safetensors headers add a few kilobytes."""
    return 3 * FP32 * count_full_parameters(config)


def block_elements(model_cfg: GPTConfig, tp: int) -> int:
    """Elements of one transformer block's parameters on one tensor-parallel rank."""
    return sum(math.prod(shard.local_shape) for shard in layer_shards(model_cfg, 1, tp).values())


def bucket_elements(model_cfg: GPTConfig, tp: int) -> int:
    """The reduce, all-gather and prefetch bucket (train/planner/zero_buckets.py): one block on a rank, at most
    DeepSpeed's default bucket."""
    return min(block_elements(model_cfg, tp), REDUCE_BUCKET_SIZE)
