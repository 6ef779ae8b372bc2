"""The fused attention as two torch.library custom ops, on the layouts the projections use.

A block's QKV projection makes one (B, T, H·3·D) tensor, its rows ordered (head, {q, k, v}, d_head)
(model.layers.SelfAttention), and its output projection reads one (B, T, H·D) tensor. The ops take and
return exactly those, so nothing is copied around the attention, forward or backward:

  gpt3d::attention(qkv, D, lo, hi, impl, deterministic) → (O, LSE)        O (B, T, H·D), LSE (B, H, T)
  gpt3d::attention_backward(qkv, O, LSE, dO, D, lo, hi, impl, deterministic) → dQKV (B, T, H·3·D)

with the math of model/attention_torch.py (impl "torch") or the kernels of model/attention_triton.py
(impl "triton"), which read q, k and v in place from the packed buffer, write O with the heads already
merged, and write dQ, dK and dV into one gradient laid out as the projection's output: the gradient
the projection's backward reads. The "torch" implementation computes on unpacked (B, H, T, D) views and
packs its results (a CPU path: the copies cost nothing that matters there).

The model calls them eager and compiled alike (model.attention.packed_attention). The compiler
(model/compile.py) sees each as one opaque call with a registered backward; an instrument that runs
the model on fake tensors (bench/step_bill.py) sees one op where the GPU runs the kernels.
"""

from __future__ import annotations

import torch

from model import attention_torch

TORCH_BLOCK = 128  # query rows per block of the "torch" implementation (its default)


def _heads(qkv: torch.Tensor, head_dim: int) -> tuple[int, int, int]:
    """(B, T, H) of a packed (B, T, H·3·D) tensor."""
    b, t, width = qkv.shape
    return b, t, width // (3 * head_dim)


def _unpacked(qkv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v, each a (B, H, T, D) view of the packed (B, T, H·3·D) tensor."""
    b, t, h = _heads(qkv, head_dim)
    return qkv.view(b, t, h, 3, head_dim).permute(3, 0, 2, 1, 4).unbind(0)


def _merged(o: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) → (B, T, H·D): a view when o is laid out as (B, T, H, D), else a copy."""
    b, h, t, d = o.shape
    return o.transpose(1, 2).reshape(b, t, h * d)


def _lse_dtype(qkv: torch.Tensor, impl: str) -> torch.dtype:
    """The Triton kernel keeps LSE in float32; the torch path in its compute dtype."""
    return torch.float32 if impl == "triton" else attention_torch._compute_dtype(qkv)


@torch.library.custom_op("gpt3d::attention_backward", mutates_args=())
def attention_backward(qkv: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor, head_dim: int,
                       lo: int, hi: int, impl: str, deterministic: bool) -> torch.Tensor:
    b, t, h = _heads(qkv, head_dim)
    o_heads = o.view(b, t, h, head_dim).transpose(1, 2)  # (B, H, T, D) views
    do_heads = do.view(b, t, h, head_dim).transpose(1, 2)  # (B, H, T, D)
    if impl == "triton":
        from model import attention_triton

        packed = (qkv.view(b, t, h, 3, head_dim),)  # the kernels' packed layout
        (dqkv,) = attention_triton.flash_backward(packed, o_heads, lse, do_heads, lo, hi, deterministic)
        return dqkv.view(b, t, -1)  # (B, T, H·3·D)
    grads = attention_torch._backward(*_unpacked(qkv, head_dim), o_heads, lse, do_heads, lo, hi, TORCH_BLOCK)
    return torch.stack([g.transpose(1, 2) for g in grads], dim=3).reshape(b, t, -1)  # (B, T, H·3·D)


@attention_backward.register_fake
def _(qkv, o, lse, do, head_dim, lo, hi, impl, deterministic):
    return torch.empty_like(qkv)


@torch.library.custom_op("gpt3d::attention", mutates_args=())
def attention_forward(qkv: torch.Tensor, head_dim: int, lo: int, hi: int, impl: str,
                      deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = _unpacked(qkv, head_dim)
    if impl == "triton":
        from model import attention_triton

        attention_triton.check_inputs(q, k, v)
        b, t, h = _heads(qkv, head_dim)
        o, lse = attention_triton.flash_forward((qkv.view(b, t, h, 3, head_dim),), lo, hi)
    else:
        o, lse = attention_torch._forward(q, k, v, lo, hi, TORCH_BLOCK)
    return _merged(o), lse  # (B, T, H·D): the Triton kernel wrote O with the heads merged (a view), torch a copy


@attention_forward.register_fake
def _(qkv, head_dim, lo, hi, impl, deterministic):
    b, t, h = _heads(qkv, head_dim)
    return qkv.new_empty(b, t, h * head_dim), qkv.new_empty(b, h, t, dtype=_lse_dtype(qkv, impl))


def _setup_context(ctx, inputs, output):
    qkv, head_dim, lo, hi, impl, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(qkv, o, lse)
    ctx.band = (head_dim, lo, hi, impl, deterministic)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zeros made for LSE's (absent) gradient


def _backward(ctx, do, _dlse):
    if do is None:  # nothing reached O (grads are not materialized: None, not zeros)
        return None, None, None, None, None, None
    qkv, o, lse = ctx.saved_tensors
    return attention_backward(qkv, o, lse, do, *ctx.band), None, None, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)
