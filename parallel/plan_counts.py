"""What one rank of a layout holds: its parameters, and the bytes of its weights, gradients, fp32
master weights and Adam moments, counted the way the built system allocates them.

Parameters. The model is the flat layer list [Embedding, Block_0 … Block_{L-1}, final norm]; with
pp > 1 DeepSpeed's PipelineModule cuts the list [Embedding, blocks…, final norm, tied unembedding]
with `partition_balanced` over "is a PipeBlock" weights (parallel/pipeline.py), so this module asks
that very function where the cuts fall. The tied embedding is held by the first and, as the
unembedding, by the last stage (two copies of wte *and* wpe); tensor parallelism splits QKV and fc by
rows, the two output projections by columns, and the vocabulary (zero-padded to a multiple of 128·tp)
by rows (parallel/tensor.py); LayerNorms, output-projection biases and wpe are replicated.

Bytes (DeepSpeed 0.19 with the fp32 parameters gpt3d trains, Adam with two fp32 moments):

  ZeRO 0   weights 4N, gradients 4N, moments 8N; no separate master copy (the weights are fp32).
  ZeRO 1,2 each optimizer group (matrices with decay, vectors without) is flattened and padded to a
           multiple of 2·dp elements: weights 4·flat. Rank r
           owns partition r (flat/dp elements) and keeps an fp32 clone of it (master), its two moments,
           and at the step a gradient buffer holding every parameter that overlaps its partition (the last
           rank also the padding).
  ZeRO 3   every parameter is padded to a multiple of dp and cut into dp pieces: weights = the pieces
           plus full (padded) copies of "persistent" parameters (≤ 1e5 elements); gradients, master and
           moments = one piece each. Two fixed buffers: a gradient reduce bucket of 5e8 elements per
           communication dtype (allocated up front), counted as `buffers`.

With optimizer offload the master weights and moments live in host memory (`host`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from model import GPTConfig
from parallel.tensor import padded_vocab_size

FP32 = 4
NCCL_START_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor
REDUCE_BUCKET_SIZE = 500_000_000  # DeepSpeed's default zero_optimization.reduce_bucket_size (elements)
PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default stage3_param_persistence_threshold (elements)


@dataclass(frozen=True)
class ParamShape:
    """One parameter as a rank holds it.

    name: the full model's parameter name ("layers.3.attn.qkv.weight"); shape: this rank's piece;
    full_numel: the full parameter's elements (without vocabulary padding); replicated: every tp rank
    holds the same copy; owner: this copy is the one counted when the ranks' shards are added up
    (tp rank 0 for replicated parameters, the first stage for the tied embedding); linear: a plain
    nn.Linear parameter (under autocast DeepSpeed reduces its gradient in bf16).
    """

    name: str
    shape: tuple[int, ...]
    full_numel: int
    replicated: bool = False
    owner: bool = True
    linear: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def decay(self) -> bool:
        """In the weight-decay group: matrices (train/optimizer.param_groups)."""
        return len(self.shape) >= 2


@lru_cache(maxsize=None)
def stage_bounds(n_layer: int, pp: int) -> tuple[tuple[int, int], ...]:
    """[start, stop) of each stage in DeepSpeed's layer-spec list [Embedding, Block × L, final norm,
    tied unembedding], as PipelineModule(partition_method="type:PipeBlock") cuts it."""
    from deepspeed.runtime.utils import partition_balanced

    weights = [0] + [1] * n_layer + [0, 0]
    parts = [int(p) for p in partition_balanced(weights, pp)]
    return tuple(zip(parts[:-1], parts[1:]))


def stage_blocks(n_layer: int, pp: int, stage: int) -> range:
    """Indices (0-based) of the transformer blocks on `stage`."""
    if pp == 1:
        return range(n_layer)
    start, stop = stage_bounds(n_layer, pp)[stage]
    return range(max(start - 1, 0), min(stop - 1, n_layer))


def _embedding(cfg: GPTConfig, tp: int, owner: bool) -> list[ParamShape]:
    rows = padded_vocab_size(cfg.vocab_size, tp) // tp if tp > 1 else cfg.vocab_size
    d = cfg.d_model
    return [
        ParamShape("layers.0.wte.weight", (rows, d), cfg.vocab_size * d, owner=owner),
        ParamShape("layers.0.wpe.weight", (cfg.seq_len, d), cfg.seq_len * d, replicated=True, owner=owner),
    ]


def _block(cfg: GPTConfig, tp: int, index: int) -> list[ParamShape]:
    d, f, linear = cfg.d_model, cfg.d_ff, tp == 1
    prefix = f"layers.{index + 1}."

    def vector(name, n, sharded=False, is_linear=False):
        return ParamShape(prefix + name, (n // tp if sharded else n,), n, replicated=not sharded, linear=is_linear)

    def matrix(name, rows, cols, shard_rows):
        shape = (rows // tp, cols) if shard_rows else (rows, cols // tp)
        return ParamShape(prefix + name, shape, rows * cols, linear=linear)

    return [
        vector("ln_1.weight", d), vector("ln_1.bias", d),
        matrix("attn.qkv.weight", 3 * d, d, True), vector("attn.qkv.bias", 3 * d, tp > 1, linear),
        matrix("attn.proj.weight", d, d, False), vector("attn.proj.bias", d, False, linear),
        vector("ln_2.weight", d), vector("ln_2.bias", d),
        matrix("mlp.fc.weight", f, d, True), vector("mlp.fc.bias", f, tp > 1, linear),
        matrix("mlp.proj.weight", d, f, False), vector("mlp.proj.bias", d, False, linear),
    ]  # fmt: skip


def _final_norm(cfg: GPTConfig) -> list[ParamShape]:
    d, prefix = cfg.d_model, f"layers.{cfg.n_layer + 1}.ln_f."
    return [ParamShape(prefix + "weight", (d,), d, replicated=True), ParamShape(prefix + "bias", (d,), d, replicated=True)]


def rank_parameters(cfg: GPTConfig, tp: int, pp: int, stage: int) -> list[ParamShape]:
    """The parameters of a rank on pipeline stage `stage`, in the order its optimizer sees them
    (every tp rank of a stage holds the same shapes). pp = 1: GPT.parameters(); pp > 1:
    PipelineModule.parameters(), the tied embedding first."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} does not exist with pp={pp}")
    blocks = [p for i in stage_blocks(cfg.n_layer, pp, stage) for p in _block(cfg, tp, i)]
    if pp == 1:
        return _embedding(cfg, tp, owner=True) + blocks + _final_norm(cfg)
    start, stop = stage_bounds(cfg.n_layer, pp)[stage]
    tied_here = start == 0 or stop == cfg.n_layer + 3
    params = _embedding(cfg, tp, owner=start == 0) if tied_here else []
    return params + blocks + (_final_norm(cfg) if start <= cfg.n_layer + 1 < stop else [])


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


def unused_parameters(pp: int, stage: int) -> frozenset[str]:
    """Parameters a stage holds but never uses, so they get no gradient: the last stage's copy of the
    position table (the tied embedding is built whole there, but only its wte unembeds)."""
    return frozenset({"layers.0.wpe.weight"}) if pp > 1 and stage == pp - 1 else frozenset()


def _zero12(params: list[ParamShape], dp: int, dp_rank: int, unused: frozenset[str]) -> tuple[int, int, int]:
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
        grad_total += sum(p.numel for p in mine if p.name in unused)  # a zero gradient of its own
        if dp_rank == dp - 1:
            grad_total += flat - offset  # the last partition's alignment padding, a zero tensor of its own
        flat_total, partition_total = flat_total + flat, partition_total + part
    return flat_total, partition_total, grad_total


def state_bytes(
    params: list[ParamShape], zero_stage: int, dp: int, dp_rank: int = 0, offload: bool = False,
    comm_dtype_bytes: tuple[int, ...] = (FP32,), unused: frozenset[str] = frozenset(),
) -> StateBytes:  # fmt: skip
    """The bytes a rank holding `params` keeps under ZeRO `zero_stage` over `dp` data-parallel ranks.

    comm_dtype_bytes: element sizes of the gradient-reduction dtypes (fp32; with autocast on a GPU
    and plain nn.Linear layers also bf16): ZeRO 3 keeps one reduce bucket per dtype. unused: names of
    parameters without a gradient (`unused_parameters`).
    """
    n = sum(p.numel for p in params)
    if zero_stage == 0:
        return StateBytes(weights=FP32 * n, gradients=FP32 * n, master=0, moments=2 * FP32 * n, partition=n)
    if zero_stage in (1, 2):
        flat, part, grads = _zero12(params, dp, dp_rank, unused)
        master, moments = FP32 * part, 2 * FP32 * part
        host = master + moments if offload else 0
        return StateBytes(
            weights=FP32 * flat, gradients=FP32 * grads, master=0 if offload else master,
            moments=0 if offload else moments, host=host, partition=part, details={"flat": flat},
        )  # fmt: skip
    if zero_stage == 3:
        pieces = sum(-(-p.numel // dp) for p in params)
        # a persistent parameter stays gathered, in the padded buffer it was all-gathered into
        persistent = sum(-(-p.numel // dp) * dp for p in params if p.numel <= PERSISTENCE_THRESHOLD)
        master, moments = FP32 * pieces, 2 * FP32 * pieces
        return StateBytes(
            weights=FP32 * (pieces + persistent), gradients=FP32 * pieces, master=0 if offload else master,
            moments=0 if offload else moments, buffers=REDUCE_BUCKET_SIZE * sum(comm_dtype_bytes),
            host=master + moments if offload else 0, partition=pieces, details={"persistent": persistent},
        )  # fmt: skip
    raise ValueError(f"zero_stage={zero_stage!r}: must be one of [0, 1, 2, 3]")


def count_full_parameters(cfg: GPTConfig) -> int:
    """Parameters of the whole (unsharded, tied) model: what count_parameters(GPT(cfg)) gives."""
    return sum(p.full_numel for p in rank_parameters(cfg, 1, 1, 0))
