"""Tensor parallelism, Megatron-LM style: how heads, MLP columns and the vocabulary are split.

With p = tp ranks, every transformer block keeps its two matrix pairs local between one
all-reduce and the next:

  attention  x (B, T, d) ─ qkv: column-parallel ─► (B, T, 3d/p) = this rank's n_head/p whole heads
             ─ attention on local heads ─► (B, T, d/p) ─ proj: row-parallel ─► all-reduce ─► (B, T, d)
  MLP        x (B, T, d) ─ fc: column-parallel ─► (B, T, d_ff/p) ─ GELU ─ proj: row-parallel ─► all-reduce

The QKV weight's output rows are ordered (head, {q, k, v}, d_head), so a contiguous 1/p of its
rows is whole heads, and the model's `view(B, T, -1, 3, d_head)` yields n_head/p local heads.
The vocabulary is zero-padded to a multiple of 128·p and split by rows; the tied unembedding
produces (B, T, Vp/p) logits per rank and vocab_parallel_cross_entropy turns them into the
loss without ever gathering (B, T, V).

Communication per block and step, without sequence parallelism: forward, two all-reduces of
B·T·d elements (after attn.proj and mlp.proj); backward, two more (the input gradients of attn.qkv
and mlp.fc). With sequence parallelism each all-reduce becomes an all-gather before the column
layer and a reduce-scatter after the row layer, and activations between blocks are (B, T/p, d).

`shard_layer(layer, topology, index=i)` applies a plan (module name → "column" | "row" | "vocab" |
"sequence") to layer i of the model's flat list, normally still on the meta device, and `shard`
does it to a whole GPT; init then draws every parameter full and keeps this rank's piece (see
model/init.py), so the weights equal the one-process model's whatever tp is. Which rows or
columns a rank holds is `shard_range` of the dimension SPLIT_DIMS names, for the modules here and
for parallel/naming.py alike.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model.fused_loss import fused_linear_cross_entropy
from model.layers import Embedding
from model.modes import Fixed
from model.recompute import Linear, Recompute, linear, matmuls_for
from model.vocab import PaddedEmbedding, PaddedUnembedding, padded_vocab_size
from parallel.comm import (
    all_reduce,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    overlapped_reduction,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
    sequence_gather,
)
from parallel.overlap import Ring, gathered_linear, scattered_linear
from parallel.ring_operands import ring_operands
from parallel.topology import check_layout

TP_PLAN = {
    "attn.qkv": "column",
    "attn.proj": "row",
    "mlp.fc": "column",
    "mlp.proj": "row",
    "wte": "vocab",
    "lm_head": "vocab",
}
# With sequence parallelism the LayerNorms work on 1/p of the sequence and gather it for the
# column-parallel layer that follows each of them.
SEQUENCE_PARALLEL_PLAN = {"ln_1": "sequence", "ln_2": "sequence", "ln_f": "sequence"}
# The LayerNorms whose output feeds a column-parallel layer (ln_f feeds the vocab-parallel unembedding).
NORM_BEFORE_COLUMN = ("ln_1", "ln_2")
# Per style, the dimension along which each parameter is cut over the tp ranks (absent: every rank
# holds all of it). "vocab" cuts the vocabulary after padding it to padded_vocab_size (model/vocab.py),
# and pads it at tp = 1 too.
SPLIT_DIMS = {"column": {"weight": 0, "bias": 0}, "row": {"weight": 1}, "vocab": {"weight": 0}, "sequence": {}}


def shard_range(length: int, rank: int, size: int, padded: int | None = None) -> tuple[int, int, int]:
    """Rank's piece of a dimension of `length` cut into `size` equal pieces after zero-padding it to
    `padded` entries: (start, stop, local). The rank's `local` entries hold the full tensor's
    [start, stop) first, then stop − start … local − 1 are padding (only for padded > length)."""
    local = _local(length if padded is None else padded, size, "split dimension")
    start, stop = min(rank * local, length), min((rank + 1) * local, length)
    return start, stop, local


def _piece(full: torch.Tensor, dim: int, rank: int, size: int, padded_rows: int | None = None) -> torch.Tensor:
    """Rank's 1/size of `full` along dim, after zero-padding dim to padded_rows (see shard_range)."""
    start, stop, local = shard_range(full.shape[dim], rank, size, padded_rows)
    piece = full.new_zeros(*full.shape[:dim], local, *full.shape[dim + 1 :])
    piece.narrow(dim, 0, stop - start).copy_(full.narrow(dim, start, stop - start))
    return piece


def _local(n: int, size: int, what: str) -> int:
    """n / size, refusing a remainder (a plan may point a style at a layer whose width tp does not divide)."""
    if n % size:
        raise ValueError(f"{what}={n} is not divisible by tp={size}")
    return n // size


def _mark(param: nn.Parameter, full_shape, dim: int, rank: int, size: int, padded: int | None = None) -> None:
    """The attributes init (full_shape, shard_of) and DeepSpeed's grad norm (model_parallel) read."""
    param.full_shape = tuple(full_shape)
    param.shard_of = partial(_piece, dim=dim, rank=rank, size=size, padded_rows=padded)
    param.model_parallel = True


class ColumnParallelLinear(nn.Module):
    """y = x Aᵀ + b with A (n, k) split by output rows: rank i holds A_i = A[i·n/p : (i+1)·n/p] and b_i
    and returns its n/p output features y_i = x A_iᵀ + b_i.

    x is replicated, and ∂L/∂x = Σ_i (∂L/∂y_i) A_i is a sum over ranks, all-reduced in backward. How,
    is fixed when the layer is built (`overlap`, `sequence_parallel`), as three parts of one forward:
      copy_input         no overlap, no sequence parallelism: copy_to_tp_region sums ∂L/∂x after the
                         whole backward
      reduce_input_grad  overlap (parallel.overlap_communication): the all-reduce is issued
                         asynchronously before the weight-gradient product ∂L/∂A_i = (∂L/∂y_i)ᵀ x and
                         waited on after it (parallel.comm.overlapped_reduction)
      gather_input       overlap with sequence parallelism: the layer gathers its (B, T/p, k) input
                         itself, so the reduction it overlaps is that gather's adjoint, a reduce-scatter
                         (the LayerNorm before it leaves its output split: SequenceParallelLayerNorm)
    Sequence parallelism without overlap: the LayerNorm before gathers, and its backward reduce-scatters.
    Built with `fp8` (a model.modes.Float8) the products run in float8 (model/float8.py), W's and g's amaxes
    reduced over the group (they are split by output features; x is whole on every rank).
    Built with `weight_grads` (model/weight_grads.py) the weight-gradient product is deferred to that store;
    the input gradient's reduction stays in the backward, then with nothing to overlap.
    Built with `ring_overlap` (parallel.tp_comm_overlap, sequence parallelism only) the layer gathers its input
    ring step by step behind the GEMM's chunks and reduce-scatters its input gradient the same way
    (parallel/overlap.py): every collective of the layer is hidden, also when W is deferred. In float8 the
    input's pieces travel quantized, with the scale of the whole (parallel/ring_operands.py).
    """

    sequence_parallel = Fixed()
    overlap = Fixed()
    ring_overlap = Fixed()
    fp8 = Fixed()
    matmuls = Fixed()
    weight_grads = Fixed()

    def __init__(
        self, in_features, out_features, group, bias=True, sequence_parallel=False, tag="", device=None, dtype=None,
        overlap=False, fp8=None, weight_grads=None, ring_overlap=False,
    ):
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.tag = group, tag
        self.sequence_parallel, self.overlap, self.weight_grads = sequence_parallel, overlap, weight_grads
        self.fp8, self.matmuls = fp8, matmuls_for(fp8, "out", _reduce_max(group, tag))
        self.ring_overlap, self.ring = ring_overlap, _ring(ring_overlap, sequence_parallel, group, tag)
        self.ring_ops = ring_operands(self.matmuls) if self.ring is not None else None
        local = _local(out_features, size, f"{tag or 'column-parallel'} out_features")
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        _mark(self.weight, (out_features, in_features), SPLIT_DIMS["column"]["weight"], rank, size)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(local, device=device, dtype=dtype))
            _mark(self.bias, (out_features,), SPLIT_DIMS["column"]["bias"], rank, size)
        self.copy_input = not (sequence_parallel or overlap or ring_overlap)
        self.reduce_input_grad = None
        if overlap and not ring_overlap:
            self.reduce_input_grad = overlapped_reduction(group, tag, sequence_dim=1 if sequence_parallel else None)
        gathers = sequence_parallel and overlap and not ring_overlap  # (the ring gathers its input itself)
        self.gather_input = sequence_gather(group, tag, dim=1) if gathers else None

    def forward(self, x: torch.Tensor, recompute: Recompute | None = None) -> torch.Tensor:
        """x (B, T, k) replicated, or this rank's (B, T/p, k) when the layer gathers it; recompute: how
        backward gets x back instead of keeping it (model/recompute.py)."""
        if self.ring is not None:  # x (B, T/p, k): under sequence parallelism the LayerNorm before recomputes nothing
            weight_grads = self.weight_grads if torch.is_grad_enabled() else None
            return gathered_linear(x, self.weight, self.bias, self.ring, weight_grads, self.ring_ops)  # (B, T, n/p)
        if self.copy_input:
            x = copy_to_tp_region(x, self.group, self.tag)
        grad = torch.is_grad_enabled()
        reduce_input_grad, weight_grads = (self.reduce_input_grad, self.weight_grads) if grad else (None, None)
        return linear(x, self.weight, self.bias, recompute, reduce_input_grad, self.gather_input,
                      self.matmuls, weight_grads)  # (B, T, n/p)


class RowParallelLinear(nn.Module):
    """y = x Aᵀ + b with A (n, k) split by input columns: rank i holds A_i = A[:, i·k/p : (i+1)·k/p] and
    receives x_i, the matching k/p features (a column-parallel layer's output); y = Σ_i x_i A_iᵀ + b.

    The sum is an all-reduce (reduce_from_tp_region), or with sequence parallelism a reduce-scatter
    that leaves each rank its 1/p of the sequence. b is replicated and added once, after the sum;
    with sequence parallelism each rank's b sees only its tokens, so its gradient is summed over ranks.
    Built with `fp8` (a model.modes.Float8) the products run in float8 (model/float8.py), x's and W's amaxes
    reduced over the group (both are split by input features; g is whole on every rank).
    Built with `weight_grads` (model/weight_grads.py) the weight-gradient product is deferred to that store
    (b's gradient, taken after the sum, is not).
    Built with `ring_overlap` (parallel.tp_comm_overlap, sequence parallelism only) the sum is reduce-scattered
    ring step by step behind the GEMM's chunks, and backward gathers ∂L/∂y the same way (parallel/overlap.py);
    in float8, ∂L/∂y's pieces travel quantized (parallel/ring_operands.py).
    """

    sequence_parallel = Fixed()
    ring_overlap = Fixed()
    fp8 = Fixed()
    matmuls = Fixed()
    weight_grads = Fixed()

    def __init__(
        self, in_features, out_features, group, bias=True, sequence_parallel=False, tag="", device=None, dtype=None,
        fp8=None, weight_grads=None, ring_overlap=False,
    ):  # fmt: skip
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.sequence_parallel, self.tag = group, sequence_parallel, tag
        self.weight_grads = weight_grads
        self.fp8, self.matmuls = fp8, matmuls_for(fp8, "in", _reduce_max(group, tag))
        self.ring_overlap, self.ring = ring_overlap, _ring(ring_overlap, sequence_parallel, group, tag)
        self.ring_ops = ring_operands(self.matmuls) if self.ring is not None else None
        local = _local(in_features, size, f"{tag or 'row-parallel'} in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype))
        _mark(self.weight, (out_features, in_features), SPLIT_DIMS["row"]["weight"], rank, size)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor, recompute: Recompute | None = None) -> torch.Tensor:  # x (B, T, k/p)
        """recompute: how backward gets x back instead of keeping it (model/recompute.py)."""
        weight_grads = self.weight_grads if torch.is_grad_enabled() else None
        if self.ring is not None:
            y = scattered_linear(x, self.weight, self.ring, recompute, weight_grads, self.ring_ops)  # (B, T/p, n)
            return y if self.bias is None else y + copy_to_tp_region(self.bias, self.group, self.tag)
        partial_sum = linear(x, self.weight, None, recompute, matmuls=self.matmuls,
                             weight_grads=weight_grads)  # (B, T, n), this rank's term of Σ_i
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial_sum, self.group, dim=1, tag=self.tag)  # (B, T/p, n)
            bias = None if self.bias is None else copy_to_tp_region(self.bias, self.group, self.tag)
        else:
            y = reduce_from_tp_region(partial_sum, self.group, self.tag)  # (B, T, n)
            bias = self.bias
        return y if bias is None else y + bias


class VocabParallelEmbedding(nn.Module):
    """E[ids] with E (V, d) zero-padded to Vp = padded_vocab_size(V, p) rows and split by rows: rank i
    holds rows [i·Vp/p, (i+1)·Vp/p). Each rank looks up the ids it owns and writes zeros for the
    others; the all-reduce sums to E[ids]. Backward: each rank's rows get their own ids' gradients.
    """

    def __init__(self, num_embeddings, embedding_dim, group, tag="", device=None, dtype=None):
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        padded = padded_vocab_size(num_embeddings, size)
        self.group, self.tag = group, tag
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start, self.local_rows = rank * padded // size, padded // size
        self.weight = nn.Parameter(torch.empty(self.local_rows, embedding_dim, device=device, dtype=dtype))
        _mark(self.weight, (num_embeddings, embedding_dim), SPLIT_DIMS["vocab"]["weight"], rank, size, padded)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids (B, T)
        local = ids - self.vocab_start
        foreign = (local < 0) | (local >= self.local_rows)  # (B, T): ids another rank owns
        out = F.embedding(local.masked_fill(foreign, 0), self.weight)  # (B, T, d)
        out = out.masked_fill(foreign.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.group, self.tag)  # (B, T, d)


class VocabParallelUnembedding(nn.Module):
    """Logits for this rank's vocabulary shard, z_i = h E_iᵀ: (B, T, d) → (B, T, Vp/p), with E_i the
    rank's rows of the embedding (the weight is tied to VocabParallelEmbedding's; GPT.tie_weights).

    h is replicated and ∂L/∂h = Σ_i (∂L/∂z_i) E_i is a sum over ranks (copy_to_tp_region; with sequence
    parallelism, the final LayerNorm's gather). Columns ≥ V are padding: the loss and gather_logits
    drop them.

    `loss(h, targets)` is the mean cross-entropy, in the mode fixed at construction: with `fused_loss`
    chunk by chunk without the logits (model/fused_loss.py), with the three all-reduces of
    _VocabParallelCrossEntropy per chunk over the tp group; else from this rank's logits, by
    vocab_parallel_cross_entropy. h's gradient is this rank's term, summed as above.
    """

    sequence_parallel = Fixed()
    fused_loss = Fixed()

    def __init__(self, vocab_size, in_features, group, sequence_parallel=False, tag="", device=None, dtype=None,
                 fused_loss=False):
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        padded = padded_vocab_size(vocab_size, size)
        self.group, self.tag = group, tag
        self.sequence_parallel, self.fused_loss = sequence_parallel, fused_loss
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(padded // size, in_features, device=device, dtype=dtype))
        _mark(self.weight, (vocab_size, in_features), SPLIT_DIMS["vocab"]["weight"], rank, size, padded)

    def _replicated(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.sequence_parallel else copy_to_tp_region(h, self.group, self.tag)  # (B, T, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self._replicated(h), self.weight)  # (B, T, Vp/p)

    def loss(self, h: torch.Tensor, targets: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """Mean cross-entropy of the logits of h (B, T, d) against targets (B, T) (chunk: tokens per chunk
        of the fused loss, model.fused_loss.token_chunk by default)."""
        if not self.fused_loss:
            return vocab_parallel_cross_entropy(self(h), targets, self.group, self.vocab_size)
        group, tag = self.group, "loss"
        return fused_linear_cross_entropy(
            self._replicated(h), self.weight, targets, self.vocab_size, chunk=chunk,
            start=dist.get_rank(group) * self.weight.shape[0],
            reduce_max=lambda x: all_reduce(x, group, tag, "forward", op=dist.ReduceOp.MAX),
            reduce_sum=lambda x: all_reduce(x, group, tag, "forward"),
        )


class SequenceParallelLayerNorm(nn.LayerNorm):
    """LayerNorm on this rank's 1/p of the sequence, then the all-gather the next column-parallel layer
    needs: (B, T/p, d) → (B, T, d). γ and β are replicated but see only local tokens, so their
    gradients are summed over ranks (copy_to_tp_region). Built with gather_output off it returns its
    (B, T/p, d) piece, for a column-parallel layer that gathers it itself (one that overlaps)."""

    gather_output = Fixed()
    sequence_parallel = True  # its output is gathered over ranks: a Block keeps it rather than recompute it

    def __init__(self, normalized_shape, eps, group, tag="", device=None, dtype=None, gather_output=True):
        super().__init__(normalized_shape, eps=eps, device=device, dtype=dtype)
        self.group, self.tag, self.gather_output = group, tag, gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T/p, d)
        weight = copy_to_tp_region(self.weight, self.group, self.tag)
        bias = copy_to_tp_region(self.bias, self.group, self.tag)
        y = F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)  # (B, T/p, d)
        if not self.gather_output:
            return y
        return gather_from_sequence_parallel_region(y, self.group, dim=1, tag=self.tag)  # (B, T, d)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean over kept tokens n of ℓ_n = log Σ_{j<V} exp z_nj − z_{n,y_n}, from vocab-sharded logits.

    With m_n = max_j z_nj (all-reduce MAX), S_n = Σ_j exp(z_nj − m_n) (all-reduce SUM of the ranks'
    partial sums) and z_{n,y_n} − m_n taken from the rank that owns y_n (all-reduce SUM, zeros
    elsewhere): ℓ_n = log S_n − (z_{n,y_n} − m_n). Padded columns j ≥ V are set to −∞ first, so they
    never enter the softmax. The gradient is local: ∂ℓ_n/∂z_nj = softmax_nj − [j = y_n].
    """

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size, ignore_index, tag):
        n_local = logits.shape[-1]
        start = dist.get_rank(group) * n_local
        z = logits.float()  # (N, Vp/p)
        if start + n_local > vocab_size:
            z = z.clone()
            z[:, max(vocab_size - start, 0) :] = float("-inf")
        m = all_reduce(z.max(dim=-1).values, group, tag, "forward", op=dist.ReduceOp.MAX)  # (N,)
        z = z - m.unsqueeze(-1)  # (N, Vp/p), ≤ 0
        local_target = targets - start
        owned = (local_target >= 0) & (local_target < n_local)  # (N,)
        local_target = local_target.clamp(0, n_local - 1)
        z_target = torch.where(owned, z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0.0)
        z_target = all_reduce(z_target, group, tag, "forward")  # (N,)
        exp = z.exp_()
        total = all_reduce(exp.sum(dim=-1), group, tag, "forward")  # (N,) = S_n
        keep = targets != ignore_index
        count = keep.sum()
        loss = torch.where(keep, total.log() - z_target, 0.0).sum() / count
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local_target, owned & keep, keep, count)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, owned, keep, count = ctx.saved_tensors
        grad = softmax.clone()  # (N, Vp/p)
        # − 1 at each owned target's column (− 0 elsewhere): no host sync to find the rows
        grad.scatter_add_(1, local_target.unsqueeze(-1), -owned.to(grad.dtype).unsqueeze(-1))
        grad *= (keep * (grad_loss / count)).unsqueeze(-1)
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits, targets, group, vocab_size, ignore_index=-100, tag="loss"):
    """Mean next-token cross-entropy from vocab-sharded logits (B, T, Vp/p) and targets (B, T).

    Equals F.cross_entropy on the gathered, unpadded (B·T, V) logits (targets == ignore_index are
    left out of the mean), computed with three all-reduces of B·T floats instead of gathering them.
    """
    flat = logits.reshape(-1, logits.shape[-1])  # (B·T, Vp/p)
    return _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), group, vocab_size, ignore_index, tag)


def gather_logits(logits: torch.Tensor, group, vocab_size: int) -> torch.Tensor:
    """Full logits (B, T, V) on every rank from the vocab shards (B, T, Vp/p): all-gather, drop padding."""
    return gather_from_tp_region(logits, group, dim=-1, tag="gather_logits")[..., :vocab_size]


class FullLogits(nn.Module):
    """A sharded GPT seen whole: forward(idx) → (B, T, V) logits on every rank (e.g. generate(FullLogits(m), …))."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, idx: torch.Tensor, cache=None) -> torch.Tensor:
        logits = self.model(idx) if cache is None else self.model(idx, cache=cache)
        head = self.model.head.lm_head
        if isinstance(head, VocabParallelUnembedding):
            logits = gather_logits(logits, head.group, head.vocab_size)
        return logits


def _ring(ring_overlap: bool, sequence_parallel: bool, group, tag: str) -> Ring | None:
    """The layer's Ring when it overlaps its collectives ring step by step (parallel.tp_comm_overlap), else None."""
    if not ring_overlap:
        return None
    if not sequence_parallel:
        raise ValueError(f"{tag}: parallel.tp_comm_overlap decomposes sequence parallelism's all-gather and "
                         "reduce-scatter; it needs parallel.sequence_parallel=true")
    return Ring(group, tag)


def _reduce_max(group, tag: str):
    """A float8 layer's amax reduction (model/float8.py): (amaxes, phase) ↦ their MAX over the group, in place."""
    return lambda amaxes, phase: all_reduce(amaxes, group, tag, phase, op=dist.ReduceOp.MAX)


def _scatter_sequence(group, tag: str):
    """Forward hook on the embedding of a sequence-parallel model: keep this rank's 1/p of its output's
    sequence, (B, T, d) → (B, T/p, d)."""

    def hook(module, inputs, output):
        return scatter_to_tp_region(output, group, dim=1, tag=tag)

    return hook


def _build(style: str, name: str, module: nn.Module, group, sequence_parallel: bool, overlap: bool,
           ring_overlap: bool = False) -> nn.Module:
    """The tensor-parallel replacement for `module` (same shapes when unsharded, same parameter names),
    built in its modes: sequence parallelism, overlap, and those kept from `module` (the unembedding's loss,
    a linear's float8 recipe and deferred weight gradients)."""
    kinds = {"column": Linear, "row": Linear, "vocab": (PaddedEmbedding, PaddedUnembedding), "sequence": nn.LayerNorm}
    if style not in kinds:
        raise ValueError(f"plan maps {name!r} to {style!r}; styles are {sorted(kinds)}")
    if not isinstance(module, kinds[style]):
        raise TypeError(f"plan maps {name!r} ({type(module).__name__}) to {style!r}, which needs {kinds[style]}")
    like = {"device": module.weight.device, "dtype": module.weight.dtype}
    if style == "sequence":  # the LayerNorm before a column layer that gathers its input itself leaves it split
        gather = not ((overlap or ring_overlap) and name.rpartition(".")[2] in NORM_BEFORE_COLUMN)
        return SequenceParallelLayerNorm(module.normalized_shape, module.eps, group, tag=name, gather_output=gather, **like)
    if style == "vocab" and isinstance(module, PaddedEmbedding):
        return VocabParallelEmbedding(module.vocab_size, module.embedding_dim, group, tag=name, **like)
    if style == "vocab":
        return VocabParallelUnembedding(module.vocab_size, module.in_features, group, sequence_parallel, tag=name,
                                        fused_loss=module.fused_loss, **like)
    has_bias = module.bias is not None
    if style == "column":
        return ColumnParallelLinear(module.in_features, module.out_features, group, has_bias, sequence_parallel,
                                    tag=name, overlap=overlap, fp8=module.fp8, weight_grads=module.weight_grads,
                                    ring_overlap=ring_overlap, **like)
    return RowParallelLinear(module.in_features, module.out_features, group, has_bias, sequence_parallel, tag=name,
                             fp8=module.fp8, weight_grads=module.weight_grads, ring_overlap=ring_overlap, **like)


def shard(
    model: nn.Module, topology, plan: dict[str, str] = TP_PLAN, sequence_parallel: bool = False, overlap: bool = True,
    ring_overlap: bool = False,
) -> nn.Module:
    """Make `model` (a GPT) tensor-parallel over topology.tp_group, in place; returns it.

    Every module whose qualified name equals a plan key or ends with "." + key is swapped for its
    tensor-parallel version, built in its modes (all are built and checked before the model is
    touched; the unembedding keeps its loss mode); the unembedding is re-tied to the vocab-parallel
    embedding. Swapped parameters carry full_shape / shard_of (init draws them
    full and keeps this rank's piece) and model_parallel=True (DeepSpeed then counts them on every
    tp rank in gradient norms; replicated ones only on tp rank 0). A model on meta stays on meta,
    for model.materialize(device, seed); a materialised one keeps its values, cut to this rank's
    pieces. With tp = 1 the model is returned unchanged.

    sequence_parallel=True also splits the activations between blocks along the sequence
    (B, T/p, d): LayerNorms run on local tokens (SEQUENCE_PARALLEL_PLAN), the embedding output is
    scattered, and T must be a multiple of tp. overlap (parallel.overlap_communication): every
    column-parallel layer overlaps its input-gradient reduction with its weight-gradient product in
    backward (ColumnParallelLinear), instead of reducing after the whole backward. ring_overlap
    (parallel.tp_comm_overlap, with sequence parallelism): the column and row layers run their all-gathers
    and reduce-scatters ring step by step behind their GEMMs' chunks (parallel/overlap.py).
    """
    if topology.tp_size == 1:
        return model
    config = model.config
    check_layout(config.n_head, config.d_ff, topology.tp_size, topology.pp_size, config.n_layer, topology.world_size)
    plan = full_plan(plan, sequence_parallel)
    check_plan(plan, [name for name, _ in model.named_modules()])
    group = topology.tp_group
    swaps = [_replacements(layer, plan, group, sequence_parallel, overlap, f"layers.{i}", ring_overlap)
             for i, layer in enumerate(model.layers)]
    for index, layer in enumerate(model.layers):  # nothing is installed before every swap was built
        _install(layer, swaps[index], group, sequence_parallel, f"layers.{index}")
    model.tie_weights()
    return model


def shard_layer(
    layer: nn.Module,
    topology,
    plan: dict[str, str] = TP_PLAN,
    sequence_parallel: bool = False,
    index: int | None = None,
    overlap: bool = True,
    ring_overlap: bool = False,
) -> nn.Module:
    """Make one layer of the flat list (an Embedding, a Block, a Head) tensor-parallel, in place.

    How a pipeline stage is sharded layer by layer: the plan applies as in `shard`, and keys that
    match nothing in this layer are fine. `index` (the layer's place in the full list) names its
    modules as the whole model does ("layers.{index}.attn.qkv") for communication tags. With
    sequence_parallel the LayerNorms become sequence-parallel and an embedding scatters its output.
    overlap and ring_overlap as in `shard`. With tp = 1 the layer is returned unchanged.
    """
    if topology.tp_size > 1:
        prefix = "" if index is None else f"layers.{index}"
        plan = full_plan(plan, sequence_parallel)
        swaps = _replacements(layer, plan, topology.tp_group, sequence_parallel, overlap, prefix, ring_overlap)
        _install(layer, swaps, topology.tp_group, sequence_parallel, prefix)
    return layer


def full_plan(plan: dict[str, str], sequence_parallel: bool) -> dict[str, str]:
    """The plan, with the LayerNorms made sequence-parallel when asked."""
    return {**plan, **SEQUENCE_PARALLEL_PLAN} if sequence_parallel else dict(plan)


def check_plan(plan: dict[str, str], module_names: list[str]) -> None:
    """Refuse plan keys that match none of the model's module names (a typo would shard nothing)."""
    unused = sorted(key for key in plan if not any(_matches(key, name) for name in module_names))
    if unused:
        raise ValueError(f"plan keys {unused} match no module of the model")


def tied_unembedding(embedding: nn.Module, vocab_size: int, topology) -> nn.Module:
    """h ↦ h Eᵀ with E `embedding`'s own weight (shared, not copied): (B, T, d) → (B, T, V) (a
    PaddedUnembedding), or with tp > 1 this rank's vocabulary shard (B, T, Vp/p) (a VocabParallelUnembedding)."""
    if topology.tp_size == 1:
        head = PaddedUnembedding(embedding.embedding_dim, vocab_size, device="meta")
    else:
        group = topology.tp_group
        head = VocabParallelUnembedding(vocab_size, embedding.embedding_dim, group, tag="unembedding", device="meta")
    head.weight = embedding.weight
    return head


def vocab_parallel_loss(vocab_size: int, topology):
    """loss_fn(logits (B, T, Vp/p), targets (B, T)) → mean cross-entropy over topology's tp group."""
    return partial(vocab_parallel_cross_entropy, group=topology.tp_group, vocab_size=vocab_size)


def plan_style(plan: dict[str, str], name: str) -> str | None:
    """The plan's style for the module of qualified name `name`, or None when it is not sharded."""
    key = next((key for key in plan if _matches(key, name)), None)
    return None if key is None else plan[key]


def _matches(key: str, name: str) -> bool:
    return name == key or name.endswith("." + key)


def _replacements(
    root: nn.Module, plan: dict[str, str], group, sequence_parallel: bool, overlap: bool, prefix: str = "",
    ring_overlap: bool = False,
) -> dict[str, nn.Module]:
    """Module name under root → its tensor-parallel replacement (built and checked, not yet installed).
    Plan keys are matched against, and tags taken from, the names with `prefix`."""
    swaps = {}
    for name, module in root.named_modules():
        full = ".".join(part for part in (prefix, name) if part)
        style = plan_style(plan, full)
        if style is not None:
            swaps[name] = _build(style, full, module, group, sequence_parallel, overlap, ring_overlap)
    return swaps


def _install(root: nn.Module, swaps: dict[str, nn.Module], group, sequence_parallel: bool, tag: str) -> None:
    for name, new in swaps.items():
        old = root.get_submodule(name)
        if old.weight.device.type != "meta":
            _copy_shards(old, new)
        parent, _, attr = name.rpartition(".")
        setattr(root.get_submodule(parent), attr, new)
    if sequence_parallel and isinstance(root, Embedding):
        root.register_forward_hook(_scatter_sequence(group, tag))


@torch.no_grad()
def _copy_shards(old: nn.Module, new: nn.Module) -> None:
    """Fill `new`'s parameters with this rank's pieces of `old`'s (full) values."""
    for name, param in new.named_parameters():
        full = old.get_parameter(name)
        shard_of = getattr(param, "shard_of", None)
        param.copy_(shard_of(full) if shard_of is not None else full)
