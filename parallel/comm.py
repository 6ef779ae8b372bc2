"""Collectives over the tensor-parallel group that autograd can differentiate through.

With p ranks in the group, each pair below is one function and its adjoint:

  copy_to_tp_region           forward: y = x                   backward: dx = Σ_ranks dy   (all-reduce)
  reduce_from_tp_region       forward: y = Σ_ranks x           backward: dx = dy
  gather_from_tp_region       forward: y = [x_0 | … | x_{p-1}] backward: dx_i = dy_i       (take own slice)
  scatter_to_tp_region        forward: y = x_i (own slice)     backward: dx = [dy_0 | … | dy_{p-1}]
  gather_from_sequence_parallel_region
                              forward: y = [x_0 | … | x_{p-1}] backward: dx_i = (Σ_ranks dy)_i (reduce-scatter)
  reduce_scatter_to_sequence_parallel_region
                              forward: y_i = (Σ_ranks x)_i     backward: dx = [dy_0 | … | dy_{p-1}]

"|" is concatenation along `dim`, x_i is rank i's piece. The first two are Megatron-LM's f and g:
a column-parallel layer starts with f (its input is replicated, its input gradient is a sum of the
ranks' partial gradients), a row-parallel layer ends with g (each rank holds a partial sum of the
output). The two sequence-parallel ones replace f and g when activations outside the
column/row pair are split along the sequence.

overlapped_reduction(group, tag) is the input-gradient reduction of a column-parallel layer run
asynchronously: model.recompute.linear's backward hands it ∂L/∂x and the weight-gradient product, it
issues the all-reduce (async_op=True), runs the product, then waits (Megatron-LM's asynchronous
gradient all-reduce). Under sequence parallelism the layer gathers its input itself
(sequence_gather) and the reduction is that gather's adjoint, the reduce-scatter. The forward
all-gather is not overlapped. Inside `with record_overlap() as steps:` it appends, in order, ("issue",
tag), ("gemm start", tag), ("gemm end", tag), ("wait", tag).

Every collective can be recorded: inside `with record_comm() as events:` each one appends a
CommEvent(op, tag, phase, nbytes), where nbytes is the size of the full tensor involved (the
all-reduced tensor; the gathered output; the reduce-scattered input). On a ring, a rank sends
2(p−1)/p·nbytes for an all-reduce and (p−1)/p·nbytes for an all-gather or a reduce-scatter, so
sequence parallelism's all-gather + reduce-scatter pair sends what the all-reduce it replaces did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

_RECORDERS: list[list["CommEvent"]] = []
_OVERLAP_RECORDERS: list[list[tuple[str, str]]] = []


@dataclass(frozen=True)
class CommEvent:
    """One collective: op is "all_reduce" | "all_gather" | "reduce_scatter"; phase "forward" | "backward";
    tag names who called it (a module's qualified name such as "layers.1.attn.proj", or "loss")."""

    op: str
    tag: str
    phase: str
    nbytes: int


@contextlib.contextmanager
def record_comm() -> Iterator[list[CommEvent]]:
    """Collect every tensor-parallel collective this process runs inside the block."""
    events: list[CommEvent] = []
    _RECORDERS.append(events)
    try:
        yield events
    finally:
        _RECORDERS.remove(events)


@contextlib.contextmanager
def record_overlap() -> Iterator[list[tuple[str, str]]]:
    """Collect the steps of every overlapped reduction this process runs inside the block, in order:
    (step, tag) with step "issue" | "gemm start" | "gemm end" | "wait"."""
    steps: list[tuple[str, str]] = []
    _OVERLAP_RECORDERS.append(steps)
    try:
        yield steps
    finally:
        _OVERLAP_RECORDERS.remove(steps)


def record_step(step: str, tag: str) -> None:
    """One step of an overlapped communication, for record_overlap's lists."""
    for steps in _OVERLAP_RECORDERS:
        steps.append((step, tag))


def overlapped_reduction(group, tag: str, sequence_dim: int | None = None):
    """The reduce_input_grad of model.recompute.linear for a column-parallel layer: (grad_x, during) →
    (Σ_ranks grad_x, during()), the all-reduce issued before during() runs and waited on after; with
    sequence_dim, a reduce-scatter along it instead, giving this rank's piece (Σ_ranks grad_x)_i."""

    def reduce_while(grad_x: torch.Tensor, during):
        if sequence_dim is None:
            _record("all_reduce", tag, "backward", grad_x)
            reduced = grad_x  # reduced in place: grad_x is the backward's own product
            work = dist.all_reduce(reduced, group=group, async_op=True)
        else:
            _record("reduce_scatter", tag, "backward", grad_x)
            stacked = _stacked_pieces(grad_x, group, sequence_dim)  # (p, …, n/p, …)
            reduced = stacked.new_empty(stacked.shape[1:])
            work = dist.reduce_scatter_tensor(reduced, stacked.flatten(0, 1), group=group, async_op=True)
        record_step("issue", tag)
        record_step("gemm start", tag)
        result = during()
        record_step("gemm end", tag)
        work.wait()
        record_step("wait", tag)
        return reduced, result

    return reduce_while


def sequence_gather(group, tag: str, dim: int = 1):
    """The gather_input of model.recompute.linear: x ↦ the ranks' pieces concatenated along dim,
    recorded as a forward all-gather (outside autograd: the layer's backward does the adjoint)."""
    return lambda x: _all_gather(x, group, dim, tag, "forward")


def record_collective(op: str, tag: str, phase: str, nbytes: int) -> None:
    """One collective of `nbytes` (the full tensor's, as CommEvent counts them), for record_comm's lists."""
    for events in _RECORDERS:
        events.append(CommEvent(op, tag, phase, nbytes))


def _record(op: str, tag: str, phase: str, full: torch.Tensor) -> None:
    record_collective(op, tag, phase, full.numel() * full.element_size())


def all_reduce(x: torch.Tensor, group, tag: str, phase: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of x over `group`, recorded; returns x."""
    _record("all_reduce", tag, phase, x)
    dist.all_reduce(x, op=op, group=group)
    return x


def _all_gather(x: torch.Tensor, group, dim: int, tag: str, phase: str) -> torch.Tensor:
    """[x_0 | … | x_{p-1}] along dim, gathered into one tensor (all_gather_into_tensor): no list of pieces
    to concatenate; along dim 0, or a dim after only size-1 ones, the result is a view of the buffer."""
    dim, size = dim % x.dim(), dist.get_world_size(group)
    gathered = x.new_empty(size * x.shape[0], *x.shape[1:])  # the pieces one after another along dim 0
    dist.all_gather_into_tensor(gathered, x.contiguous(), group=group)
    full = gathered.unflatten(0, (size, x.shape[0])).movedim(0, dim).flatten(dim, dim + 1)  # (…, p·n, …)
    _record("all_gather", tag, phase, full)
    return full


def _reduce_scatter(x: torch.Tensor, group, dim: int, tag: str, phase: str) -> torch.Tensor:
    """(Σ_ranks x)_i, this rank's piece along dim, from one stacked tensor (reduce_scatter_tensor)."""
    _record("reduce_scatter", tag, phase, x)
    stacked = _stacked_pieces(x, group, dim)  # (p, …, n/p, …)
    out = stacked.new_empty(stacked.shape[1:])
    dist.reduce_scatter_tensor(out, stacked.flatten(0, 1), group=group)
    return out


def _stacked_pieces(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """x's p equal pieces along dim stacked along a new first dimension, contiguous: (p, …, n/p, …). A
    copy only when dim has a dimension of size > 1 before it (no copy along dim 0, or for batch 1)."""
    dim, size = dim % x.dim(), dist.get_world_size(group)
    _check_divisible(x, dim, size)
    return x.unflatten(dim, (size, x.shape[dim] // size)).movedim(dim, 0).contiguous()


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's piece of x cut into p equal pieces along dim."""
    size = dist.get_world_size(group)
    _check_divisible(x, dim, size)
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def _check_divisible(x: torch.Tensor, dim: int, size: int) -> None:
    if x.shape[dim] % size:
        raise ValueError(
            f"cannot split dimension {dim} of a tensor of shape {tuple(x.shape)} into {size} equal "
            f"tensor-parallel pieces (with sequence parallelism the sequence length must be a multiple of tp)"
        )


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tag):
        ctx.group, ctx.tag = group, tag
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd may share grad with other inputs
        return all_reduce(grad, ctx.group, ctx.tag, "backward"), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tag):
        return all_reduce(x.clone(memory_format=torch.contiguous_format), group, tag, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _conjugate_pair(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd Function of (x, group, dim, tag) named `name`: `forward` on x in the forward pass,
    `backward` on its gradient; each called as op(tensor, group, dim, tag, phase)."""

    def run_forward(ctx, x, group, dim, tag):
        ctx.group, ctx.dim, ctx.tag = group, dim, tag
        return forward(x, group, dim, tag, "forward")

    def run_backward(ctx, grad):
        return backward(grad, ctx.group, ctx.dim, ctx.tag, "backward"), None, None, None

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(run_forward), "backward": staticmethod(run_backward)})


def _own_piece(x: torch.Tensor, group, dim: int, tag: str, phase: str) -> torch.Tensor:
    """This rank's piece along dim, cut locally: no communication, so nothing is recorded."""
    return _split(x, group, dim)


_GatherFromTP = _conjugate_pair("_GatherFromTP", _all_gather, _own_piece)
_ScatterToTP = _conjugate_pair("_ScatterToTP", _own_piece, _all_gather)
_GatherFromSequenceParallel = _conjugate_pair("_GatherFromSequenceParallel", _all_gather, _reduce_scatter)
_ReduceScatterToSequenceParallel = _conjugate_pair("_ReduceScatterToSequenceParallel", _reduce_scatter, _all_gather)


def copy_to_tp_region(x: torch.Tensor, group, tag: str = "") -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (Megatron's f)."""
    return _CopyToTP.apply(x, group, tag)


def reduce_from_tp_region(x: torch.Tensor, group, tag: str = "") -> torch.Tensor:
    """All-reduce forward; identity backward (Megatron's g)."""
    return _ReduceFromTP.apply(x, group, tag)


def gather_from_tp_region(x: torch.Tensor, group, dim: int = -1, tag: str = "") -> torch.Tensor:
    """Concatenate the ranks' pieces along dim; backward keeps this rank's slice of the gradient."""
    return _GatherFromTP.apply(x, group, dim, tag)


def scatter_to_tp_region(x: torch.Tensor, group, dim: int = -1, tag: str = "") -> torch.Tensor:
    """Keep this rank's 1/p slice along dim; backward all-gathers the gradient."""
    return _ScatterToTP.apply(x, group, dim, tag)


def gather_from_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1, tag: str = "") -> torch.Tensor:
    """All-gather along dim (the sequence); backward reduce-scatters the gradient along dim."""
    return _GatherFromSequenceParallel.apply(x, group, dim, tag)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1, tag: str = "") -> torch.Tensor:
    """Sum over ranks, keeping this rank's 1/p slice along dim; backward all-gathers the gradient."""
    return _ReduceScatterToSequenceParallel.apply(x, group, dim, tag)
