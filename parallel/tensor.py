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

import contextlib
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model.layers import Embedding, lm_loss
from model.recompute import Recompute, linear
from parallel.comm import (
    all_reduce,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    overlapped_reduction,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
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
VOCAB_MULTIPLE = 128
# Per style, the dimension along which each parameter is cut over the tp ranks (absent: every rank
# holds all of it). "vocab" cuts the vocabulary after padding it to padded_vocab_size.
SPLIT_DIMS = {"column": {"weight": 0, "bias": 0}, "row": {"weight": 1}, "vocab": {"weight": 0}, "sequence": {}}


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """vocab_size rounded up to a multiple of 128·tp, so every rank holds an equal, aligned shard."""
    step = VOCAB_MULTIPLE * tp
    return -(-vocab_size // step) * step


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

    x is replicated, and ∂L/∂x = Σ_i (∂L/∂y_i) A_i is a sum over ranks, all-reduced in backward: with
    overlap (parallel.overlap_communication) issued asynchronously before the weight-gradient product
    ∂L/∂A_i = (∂L/∂y_i)ᵀ x and waited on after it (parallel.comm.overlapped_reduction), without it by
    copy_to_tp_region after the whole backward. With sequence parallelism x comes from an all-gather
    whose backward is that sum.
    """

    def __init__(
        self, in_features, out_features, group, bias=True, sequence_parallel=False, tag="", device=None, dtype=None,
        overlap=True,
    ):  # fmt: skip
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.sequence_parallel, self.tag, self.overlap = group, sequence_parallel, tag, overlap
        local = _local(out_features, size, f"{tag or 'column-parallel'} out_features")
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        _mark(self.weight, (out_features, in_features), SPLIT_DIMS["column"]["weight"], rank, size)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(local, device=device, dtype=dtype))
            _mark(self.bias, (out_features,), SPLIT_DIMS["column"]["bias"], rank, size)

    def forward(self, x: torch.Tensor, recompute: Recompute | None = None) -> torch.Tensor:  # x (B, T, k), replicated
        """recompute: how backward gets x back instead of keeping it (model/recompute.py)."""
        if self.sequence_parallel:
            return linear(x, self.weight, self.bias, recompute)  # (B, T, n/p)
        if self.overlap and torch.is_grad_enabled():
            reduction = overlapped_reduction(self.group, self.tag)
            return linear(x, self.weight, self.bias, recompute, reduction)  # (B, T, n/p)
        x = copy_to_tp_region(x, self.group, self.tag)
        return linear(x, self.weight, self.bias, recompute)  # (B, T, n/p)


class RowParallelLinear(nn.Module):
    """y = x Aᵀ + b with A (n, k) split by input columns: rank i holds A_i = A[:, i·k/p : (i+1)·k/p] and
    receives x_i, the matching k/p features (a column-parallel layer's output); y = Σ_i x_i A_iᵀ + b.

    The sum is an all-reduce (reduce_from_tp_region), or with sequence parallelism a reduce-scatter
    that leaves each rank its 1/p of the sequence. b is replicated and added once, after the sum;
    with sequence parallelism each rank's b sees only its tokens, so its gradient is summed over ranks.
    """

    def __init__(
        self, in_features, out_features, group, bias=True, sequence_parallel=False, tag="", device=None, dtype=None
    ):
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.sequence_parallel, self.tag = group, sequence_parallel, tag
        local = _local(in_features, size, f"{tag or 'row-parallel'} in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype))
        _mark(self.weight, (out_features, in_features), SPLIT_DIMS["row"]["weight"], rank, size)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor, recompute: Recompute | None = None) -> torch.Tensor:  # x (B, T, k/p)
        """recompute: how backward gets x back instead of keeping it (model/recompute.py)."""
        partial_sum = linear(x, self.weight, None, recompute)  # (B, T, n), this rank's term of Σ_i
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
    """

    def __init__(self, vocab_size, in_features, group, sequence_parallel=False, tag="", device=None, dtype=None):
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        padded = padded_vocab_size(vocab_size, size)
        self.group, self.sequence_parallel, self.tag = group, sequence_parallel, tag
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(padded // size, in_features, device=device, dtype=dtype))
        _mark(self.weight, (vocab_size, in_features), SPLIT_DIMS["vocab"]["weight"], rank, size, padded)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h (B, T, d)
        if not self.sequence_parallel:
            h = copy_to_tp_region(h, self.group, self.tag)
        return F.linear(h, self.weight)  # (B, T, Vp/p)


class SequenceParallelLayerNorm(nn.LayerNorm):
    """LayerNorm on this rank's 1/p of the sequence, then the all-gather the next column-parallel layer
    needs: (B, T/p, d) → (B, T, d). γ and β are replicated but see only local tokens, so their
    gradients are summed over ranks (copy_to_tp_region). With sequence_parallel off (generation,
    see sequence_parallel_disabled) it is a plain LayerNorm of the whole sequence."""

    def __init__(self, normalized_shape, eps, group, tag="", device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, device=device, dtype=dtype)
        self.group, self.tag, self.sequence_parallel = group, tag, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T/p, d)
        if not self.sequence_parallel:
            return super().forward(x)  # (B, T, d)
        weight = copy_to_tp_region(self.weight, self.group, self.tag)
        bias = copy_to_tp_region(self.bias, self.group, self.tag)
        y = F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)  # (B, T/p, d)
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
        rows = owned.nonzero().squeeze(-1)
        grad[rows, local_target[rows]] -= 1.0
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


class _ScatterSequence:
    """Forward hook on the embedding: keep this rank's 1/p of its output's sequence, (B, T, d) → (B, T/p, d)."""

    def __init__(self, group, tag: str):
        self.group, self.tag, self.sequence_parallel = group, tag, True

    def __call__(self, module, inputs, output):
        return scatter_to_tp_region(output, self.group, dim=1, tag=self.tag) if self.sequence_parallel else None


@contextlib.contextmanager
def sequence_parallel_disabled(module: nn.Module):
    """Inside the block, a sequence-parallel model computes as the plain tensor-parallel one: the
    embedding output stays whole, LayerNorms see every token, the row-parallel layers all-reduce.
    Same weights, same math; for generation, whose steps of one token cannot be split over ranks."""
    switches = [m for m in module.modules() if hasattr(m, "sequence_parallel")]
    switches += [h for m in module.modules() for h in m._forward_hooks.values() if isinstance(h, _ScatterSequence)]
    before = [s.sequence_parallel for s in switches]
    for switch in switches:
        switch.sequence_parallel = False
    try:
        yield module
    finally:
        for switch, value in zip(switches, before):
            switch.sequence_parallel = value


def _build(style: str, name: str, module: nn.Module, group, sequence_parallel: bool) -> nn.Module:
    """The tensor-parallel replacement for `module` (same shapes when unsharded, same parameter names)."""
    kinds = {"column": nn.Linear, "row": nn.Linear, "vocab": (nn.Embedding, nn.Linear), "sequence": nn.LayerNorm}
    if style not in kinds:
        raise ValueError(f"plan maps {name!r} to {style!r}; styles are {sorted(kinds)}")
    if not isinstance(module, kinds[style]):
        raise TypeError(f"plan maps {name!r} ({type(module).__name__}) to {style!r}, which needs {kinds[style]}")
    like = {"device": module.weight.device, "dtype": module.weight.dtype}
    if style == "sequence":
        return SequenceParallelLayerNorm(module.normalized_shape, module.eps, group, tag=name, **like)
    if style == "vocab" and isinstance(module, nn.Embedding):
        return VocabParallelEmbedding(module.num_embeddings, module.embedding_dim, group, tag=name, **like)
    if style == "vocab":
        return VocabParallelUnembedding(
            module.out_features, module.in_features, group, sequence_parallel, tag=name, **like
        )
    cls = ColumnParallelLinear if style == "column" else RowParallelLinear
    has_bias = module.bias is not None
    return cls(module.in_features, module.out_features, group, has_bias, sequence_parallel, tag=name, **like)


def shard(model: nn.Module, topology, plan: dict[str, str] = TP_PLAN, sequence_parallel: bool = False) -> nn.Module:
    """Make `model` (a GPT) tensor-parallel over topology.tp_group, in place; returns it.

    Every module whose qualified name equals a plan key or ends with "." + key is swapped for its
    tensor-parallel version (all are built and checked before the model is touched); the
    unembedding is re-tied to the vocab-parallel embedding and model.loss_fn becomes
    `loss_for(model.head)`. Swapped parameters carry full_shape / shard_of (init draws them
    full and keeps this rank's piece) and model_parallel=True (DeepSpeed then counts them on every
    tp rank in gradient norms; replicated ones only on tp rank 0). A model on meta stays on meta,
    for model.materialize(device, seed); a materialised one keeps its values, cut to this rank's
    pieces. With tp = 1 the model is returned unchanged.

    sequence_parallel=True also splits the activations between blocks along the sequence
    (B, T/p, d): LayerNorms run on local tokens (SEQUENCE_PARALLEL_PLAN), the embedding output is
    scattered, and T must be a multiple of tp.
    """
    if topology.tp_size == 1:
        return model
    config = model.config
    check_layout(config.n_head, config.d_ff, topology.tp_size, topology.pp_size, config.n_layer, topology.world_size)
    plan = full_plan(plan, sequence_parallel)
    check_plan(plan, [name for name, _ in model.named_modules()])
    group = topology.tp_group
    swaps = [_replacements(layer, plan, group, sequence_parallel, f"layers.{i}") for i, layer in enumerate(model.layers)]
    for index, layer in enumerate(model.layers):  # nothing is installed before every swap was built
        _install(layer, swaps[index], group, sequence_parallel, f"layers.{index}")
    model.tie_weights()
    model.loss_fn = loss_for(model.head)
    return model


def shard_layer(
    layer: nn.Module, topology, plan: dict[str, str] = TP_PLAN, sequence_parallel: bool = False, index: int | None = None
) -> nn.Module:
    """Make one layer of the flat list (an Embedding, a Block, a Head) tensor-parallel, in place.

    How a pipeline stage is sharded layer by layer: the plan applies as in `shard`, and keys that
    match nothing in this layer are fine. `index` (the layer's place in the full list) names its
    modules as the whole model does ("layers.{index}.attn.qkv") for communication tags. With
    sequence_parallel the LayerNorms become sequence-parallel and an embedding scatters its output.
    With tp = 1 the layer is returned unchanged.
    """
    if topology.tp_size > 1:
        prefix = "" if index is None else f"layers.{index}"
        plan = full_plan(plan, sequence_parallel)
        swaps = _replacements(layer, plan, topology.tp_group, sequence_parallel, prefix)
        _install(layer, swaps, topology.tp_group, sequence_parallel, prefix)
    return layer


def set_overlap(module: nn.Module, on: bool) -> None:
    """Make every column-parallel layer in `module` overlap its input-gradient reduction with its
    weight-gradient product in backward (on), or reduce after the whole backward (off)."""
    for layer in module.modules():
        if isinstance(layer, ColumnParallelLinear):
            layer.overlap = on


def full_plan(plan: dict[str, str], sequence_parallel: bool) -> dict[str, str]:
    """The plan, with the LayerNorms made sequence-parallel when asked."""
    return {**plan, **SEQUENCE_PARALLEL_PLAN} if sequence_parallel else dict(plan)


def check_plan(plan: dict[str, str], module_names: list[str]) -> None:
    """Refuse plan keys that match none of the model's module names (a typo would shard nothing)."""
    unused = sorted(key for key in plan if not any(_matches(key, name) for name in module_names))
    if unused:
        raise ValueError(f"plan keys {unused} match no module of the model")


def loss_for(head: nn.Module | None):
    """The training loss for what `head` outputs: the vocab-parallel cross-entropy over its tp group
    when its unembedding is vocab-parallel (logits (B, T, Vp/p)), else the plain one (model.layers.lm_loss).
    The one place the loss is chosen, for a whole GPT and for a pipeline's last stage alike."""
    unembedding = getattr(head, "lm_head", None)
    if isinstance(unembedding, VocabParallelUnembedding):
        return partial(vocab_parallel_cross_entropy, group=unembedding.group, vocab_size=unembedding.vocab_size)
    return lm_loss


def tied_unembedding(embedding: nn.Module, vocab_size: int, topology) -> nn.Module:
    """h ↦ h Eᵀ with E `embedding`'s own weight (shared, not copied): (B, T, d) → (B, T, V), or with
    tp > 1 this rank's vocabulary shard (B, T, Vp/p) (a VocabParallelUnembedding)."""
    if topology.tp_size == 1:
        head = nn.Linear(embedding.embedding_dim, vocab_size, bias=False, device="meta")
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


def _replacements(root: nn.Module, plan: dict[str, str], group, sequence_parallel: bool, prefix: str = "") -> dict[str, nn.Module]:
    """Module name under root → its tensor-parallel replacement (built and checked, not yet installed).
    Plan keys are matched against, and tags taken from, the names with `prefix`."""
    swaps = {}
    for name, module in root.named_modules():
        full = ".".join(part for part in (prefix, name) if part)
        style = plan_style(plan, full)
        if style is not None:
            swaps[name] = _build(style, full, module, group, sequence_parallel)
    return swaps


def _install(root: nn.Module, swaps: dict[str, nn.Module], group, sequence_parallel: bool, tag: str) -> None:
    for name, new in swaps.items():
        old = root.get_submodule(name)
        if old.weight.device.type != "meta":
            _copy_shards(old, new)
        parent, _, attr = name.rpartition(".")
        setattr(root.get_submodule(parent), attr, new)
    if sequence_parallel and isinstance(root, Embedding):
        root.register_forward_hook(_ScatterSequence(group, tag))


@torch.no_grad()
def _copy_shards(old: nn.Module, new: nn.Module) -> None:
    """Fill `new`'s parameters with this rank's pieces of `old`'s (full) values."""
    for name, param in new.named_parameters():
        full = old.get_parameter(name)
        shard_of = getattr(param, "shard_of", None)
        param.copy_(shard_of(full) if shard_of is not None else full)
