"""Tensor-parallel communication hidden behind the GEMMs: sequence parallelism's all-gather and reduce-scatter
decomposed into ring steps, each step's exchange issued before a GEMM chunk and waited on after it (the
collective matmul of Wang et al. 2022, as Megatron/Transformer Engine's ring-exchange overlap and
torchtitan's async TP run it).

With p ranks in the tensor-parallel group, rank r holding the sequence piece x_r (B, T/p, k) and a product
f applied to row blocks (a linear: f(x) = x Wᵀ (+ b) row by row):

  gathered    y = f([x_0 | … | x_{p−1}]): p steps; at step s rank r applies f to the piece of rank (r − s) mod p,
              which it holds, while sending it to rank r + 1 and receiving the next one from rank r − 1
              (p − 1 exchanges). Returns y and the gathered input (the weight gradient's operand).
  scattered   y_r = (Σ_q f_q(x))_r, x (B, T, k') whole on every rank, f_q rank q's product: the partial sum
              of sequence piece c starts on rank c + 1 and travels the ring, each rank adding its own
              f(x_c) and sending it on; it reaches rank c after p − 1 hops, complete. The next piece's GEMM
              runs while the partial sum is in flight.

"|" concatenates along the sequence (dim 1). A column-parallel layer's forward is `gathered` (its input
arrives in sequence pieces) and its input gradient `scattered` (∂L/∂x = Σ_q g_q W_q, needed back in
pieces); a row-parallel layer's forward is `scattered` (y = Σ_q x_q W_qᵀ) and its input gradient
`gathered` (∂L/∂x_q = [g_0 | … | g_{p−1}] W_q), which also assembles the gathered output gradient for
its weight gradient. The sums are the same as the collectives', added in ring order: equal to the
undecomposed layers up to the rounding of that order (exact at p = 2).

Every exchange is recorded (parallel/comm.py's record_overlap) as ("issue", tag), ("gemm start", tag),
("gemm end", tag), ("wait", tag) with tag "<layer>:<pass> <step>/<p − 1>", and each decomposed collective
once as a CommEvent (record_comm) of the bytes the undecomposed one moves: the ring sends exactly those.
On CUDA the exchanges (batch_isend_irecv) run on NCCL's stream beside the GEMMs; on the CPU through gloo's
asynchronous work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from model.recompute import Recompute, eager_apply, parameter_grads
from model.weight_grads import WeightGradStore
from parallel.comm import record_collective, record_step
from parallel.ring_operands import PLAIN

SEQUENCE_DIM = 1


class Ring:
    """The tensor-parallel group as a ring: this rank sends to the next one and receives from the one before."""

    def __init__(self, group, tag: str):
        self.group, self.tag = group, tag
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def _exchange(self, send: torch.Tensor, receive: torch.Tensor, label: str) -> list:
        send, receive = _as_bytes(send), _as_bytes(receive)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group), dist.P2POp(dist.irecv, receive, self.prev, self.group)]
        works = dist.batch_isend_irecv(ops)
        record_step("issue", label)
        return works

    def _wait(self, works: list, label: str) -> None:
        for work in works:
            work.wait()
        record_step("wait", label)

    def _gemm(self, product: Callable, rows: torch.Tensor, label: str) -> torch.Tensor:
        record_step("gemm start", label)
        out = product(rows)
        record_step("gemm end", label)
        return out

    def gathered(self, piece: torch.Tensor, product: Callable, what: str, phase: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(product([x_0 | … | x_{p−1}]), [x_0 | … | x_{p−1}]) from this rank's piece x_r (B, T/p, k)."""
        p, outs, pieces = self.size, [None] * self.size, [None] * self.size
        current = piece.contiguous()
        for s in range(p - 1):
            owner, label = (self.rank - s) % p, f"{self.tag}:{what} {s + 1}/{p - 1}"
            pieces[owner], received = current, torch.empty_like(current)
            works = self._exchange(current, received, label)
            outs[owner] = self._gemm(product, current, label)
            self._wait(works, label)
            current = received
        last = (self.rank + 1) % p  # the piece that arrived last, with nothing left to receive behind it
        pieces[last], outs[last] = current, product(current)
        gathered = torch.cat(pieces, dim=SEQUENCE_DIM)  # (B, T, k)
        record_collective("all_gather", self.tag, phase, gathered.numel() * gathered.element_size())
        return torch.cat(outs, dim=SEQUENCE_DIM), gathered  # (B, T, n), (B, T, k)

    def scattered(self, whole: torch.Tensor, product: Callable, what: str, phase: str) -> torch.Tensor:
        """(Σ_q product_q(x))_r (B, T/p, n) from x (B, T, k') whole on every rank."""
        p = self.size
        if whole.shape[SEQUENCE_DIM] % p:
            raise ValueError(f"{self.tag}: a sequence of {whole.shape[SEQUENCE_DIM]} tokens does not split into "
                             f"{p} tensor-parallel pieces")
        pieces = _pieces(whole, p)  # (p, B, T/p, k')
        partial = product(pieces[(self.rank - 1) % p]).contiguous()  # the partial sum this rank starts
        for s in range(p - 1):
            label = f"{self.tag}:{what} {s + 1}/{p - 1}"
            received = torch.empty_like(partial)
            works = self._exchange(partial, received, label)
            own = self._gemm(product, pieces[(self.rank - 2 - s) % p], label)  # the piece whose sum arrives
            self._wait(works, label)
            partial = received + own
        record_collective("reduce_scatter", self.tag, phase, partial.numel() * partial.element_size() * p)
        return partial  # (B, T/p, n)


def _pieces(whole: torch.Tensor, p: int) -> torch.Tensor:
    """whole (B, T, k) as its p sequence pieces, each contiguous: (p, B, T/p, k), one copy of the whole (none at
    B = 1, where the pieces already are). A piece of (B, T, k) itself is strided when B > 1, and each GEMM chunk
    would copy its rows to multiply them: p copies, a launch each."""
    b, t, k = whole.shape
    return whole.reshape(b, p, t // p, k).transpose(0, 1).contiguous()  # (p, B, T/p, k)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes (gloo has no float8 type; NCCL moves the same bytes), others as they are."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t


class _GatheredLinear(torch.autograd.Function):
    """A column-parallel linear whose input arrives in sequence pieces: y = [x_0 | … | x_{p−1}] W_rᵀ + b_r forward
    (gathered), ∂L/∂x_r = (Σ_q g_q W_q)_r backward (scattered), ∂L/∂W_r = gᵀ x and ∂L/∂b_r = Σ_rows g after it
    or deferred to the weight-gradient store. `ops` (parallel/ring_operands.py): what travels and multiplies, the
    compute dtype's operands or float8 ones."""

    @staticmethod
    def forward(ctx, x, weight, bias, ring: Ring, weight_grads: WeightGradStore | None, ops):
        sent, product, state = ops.forward(x, weight, bias)
        y, gathered = ring.gathered(sent, product, "forward", "forward")
        ctx.save_for_backward(*state, gathered)
        ctx.ring, ctx.weight_grads, ctx.parameters, ctx.has_bias = ring, weight_grads, (weight, bias), bias is not None
        ctx.ops, ctx.input_dtype = ops, x.dtype
        return y  # (B, T, n/p)

    @staticmethod
    def backward(ctx, grad):  # grad (B, T, n/p)
        *state, gathered = ctx.saved_tensors
        sent, product, grad_scales = ctx.ops.backward(grad, state)
        grad_x = ctx.ring.scattered(sent, product, "input grad", "backward")  # (B, T/p, k)
        products = ctx.ops.weight_products(sent.reshape(-1, sent.shape[-1]), state, grad_scales)
        g, x = grad.reshape(-1, grad.shape[-1]), gathered.reshape(-1, gathered.shape[-1])  # (N, n/p), (N, k)
        grad_w, grad_b = _weight_grads(ctx, products, g.to(state[0].dtype), x)  # g in the weight state's dtype
        return grad_x.to(ctx.input_dtype), grad_w, grad_b, None, None, None


class _ScatteredLinear(torch.autograd.Function):
    """A row-parallel linear whose output leaves in sequence pieces: y_r = (Σ_q x_q W_qᵀ)_r forward (scattered),
    ∂L/∂x_q = [g_0 | … | g_{p−1}] W_q backward (gathered, which also gathers g), ∂L/∂W_q = gᵀ x_q after it or
    deferred. x is kept as forward multiplied it, or recomputed from `recompute`'s sources (selective
    recomputation); `ops` as in _GatheredLinear."""

    @staticmethod
    def forward(ctx, x, weight, recompute: Recompute | None, ring: Ring, weight_grads: WeightGradStore | None, ops):
        sent, product, state = ops.forward(x, weight, None)
        y = ring.scattered(sent, product, "forward", "forward")
        kept = recompute.sources if recompute is not None else (sent,)
        ctx.save_for_backward(*state, *kept)
        ctx.recompute, ctx.state_size, ctx.ops, ctx.input_dtype = recompute, len(state), ops, x.dtype
        ctx.ring, ctx.weight_grads, ctx.parameters, ctx.has_bias = ring, weight_grads, (weight, None), False
        return y  # (B, T/p, n)

    @staticmethod
    def backward(ctx, grad):  # grad (B, T/p, n)
        saved = ctx.saved_tensors
        state, kept = saved[: ctx.state_size], saved[ctx.state_size :]
        sent, product, grad_scales = ctx.ops.backward(grad, state)
        grad_x, gathered = ctx.ring.gathered(sent, product, "input grad", "backward")
        if ctx.recompute is not None:
            with torch.no_grad():
                kept = [ctx.ops.recast(ctx.recompute.fn(*kept), state)]
        products = ctx.ops.weight_products(gathered.reshape(-1, gathered.shape[-1]), state, grad_scales)  # (N, n)
        x = kept[0].reshape(-1, kept[0].shape[-1])  # (N, k/p)
        grad_w, _ = _weight_grads(ctx, products, None, x)
        return grad_x.to(ctx.input_dtype), grad_w, None, None, None, None  # grad_x (B, T, k/p)


def _weight_grads(ctx, products, g: torch.Tensor | None, x: torch.Tensor) -> tuple:
    """products.weight_grad(x) = gᵀ x and Σ_rows g (g (N, n), with a bias) now, or (None, None) with their products
    handed to the store (model/weight_grads.py)."""
    if ctx.weight_grads is not None:
        ctx.weight_grads.defer(*ctx.parameters, parameter_grads, products, x, g, ctx.has_bias)
        return None, None
    return parameter_grads(products, x, g, ctx.has_bias)


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ring: Ring,
                    weight_grads: WeightGradStore | None = None, ops=PLAIN) -> torch.Tensor:
    """x (B, T/p, k), this rank's sequence piece → (B, T, n/p): the column-parallel layer (see _GatheredLinear),
    its operands `ops` (parallel/ring_operands.py: the layer's ring_operands)."""
    return eager_apply(_GatheredLinear)(x, weight, bias, ring, weight_grads, ops)  # the exchanges break a compiled graph


def scattered_linear(x: torch.Tensor, weight: torch.Tensor, ring: Ring, recompute: Recompute | None = None,
                     weight_grads: WeightGradStore | None = None, ops=PLAIN) -> torch.Tensor:
    """x (B, T, k/p) → (B, T/p, n), this rank's sequence piece of the sum: the row-parallel layer without its
    bias (see _ScatteredLinear), its operands `ops` as in gathered_linear."""
    return eager_apply(_ScatteredLinear)(x, weight, recompute, ring, weight_grads, ops)
