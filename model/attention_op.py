"""The fused attention as two torch.library custom ops, for torch.compile (model/compile.py).

Traced by the compiler, the "torch" and "triton" implementations of model.attention would be
unrolled into their block loops (or, for Triton, not traced at all); as custom ops the compiler
sees each as one opaque call with a registered backward:

  gpt3d::attention(q, k, v, lo, hi, impl, deterministic) → (O, LSE)    O (B, H, T, D), LSE (B, H, T)
  gpt3d::attention_backward(q, k, v, O, LSE, dO, lo, hi, impl, deterministic) → (dQ, dK, dV)

with the math of model/attention_torch.py (impl "torch") or the kernels of
model/attention_triton.py (impl "triton"), unchanged. Every output is contiguous (B, H, T, D) (the
shapes the fake implementations promise the compiler); q, k, v go in separately, so the Triton
kernel's packed-QKV gradient (one buffer for the fused projection) is an eager-only saving.
model.attention.attention routes through `compiled_attention` only while torch.compile traces.
"""

from __future__ import annotations

import torch

from model import attention_torch

TORCH_BLOCK = 128  # query rows per block of the "torch" implementation (its default)


def _lse_dtype(q: torch.Tensor, impl: str) -> torch.dtype:
    """The Triton kernel keeps LSE in float32; the torch path in its compute dtype."""
    return torch.float32 if impl == "triton" else attention_torch._compute_dtype(q)


@torch.library.custom_op("gpt3d::attention_backward", mutates_args=())
def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                       do: torch.Tensor, lo: int, hi: int, impl: str,
                       deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if impl == "triton":
        from model import attention_triton

        tensors = [attention_triton._unit_stride(x) for x in (q, k, v)]
        grads = attention_triton.flash_backward(tensors, o, lse, do, lo, hi, deterministic)
    else:
        grads = attention_torch._backward(q, k, v, o, lse, do, lo, hi, TORCH_BLOCK)
    return tuple(g.contiguous() for g in grads)  # each (B, H, T, D)


@attention_backward.register_fake
def _(q, k, v, o, lse, do, lo, hi, impl, deterministic):
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


@torch.library.custom_op("gpt3d::attention", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: int, hi: int, impl: str,
                      deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if impl == "triton":
        from model import attention_triton

        attention_triton.check_inputs(q, k, v)
        o, lse = attention_triton.flash_forward([attention_triton._unit_stride(x) for x in (q, k, v)], lo, hi)
    else:
        o, lse = attention_torch._forward(q, k, v, lo, hi, TORCH_BLOCK)
    return o.contiguous(), lse  # (B, H, T, D), (B, H, T)


@attention_forward.register_fake
def _(q, k, v, lo, hi, impl, deterministic):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty(q.shape[:-1], dtype=_lse_dtype(q, impl))


def _setup_context(ctx, inputs, output):
    q, k, v, lo, hi, impl, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.band = (lo, hi, impl, deterministic)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward(q, k, v, o, lse, do.contiguous(), *ctx.band)
    return dq, dk, dv, None, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def compiled_attention(q, k, v, lo: int, hi: int, impl: str, deterministic: bool) -> torch.Tensor:
    """softmax(QKᵀ/√D + band mask) V, (B, H, T, D), through the custom ops (impl "torch" or "triton")."""
    return attention_forward(q, k, v, lo, hi, impl, deterministic)[0]
