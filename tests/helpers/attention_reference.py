"""The float64 reference that every attention test compares against, written out independently of
model code: softmax(QKᵀ/√D + mask)V with autograd."""

import math

import torch

from model.attention import attention

HEAD_DIMS = (64, 80, 96, 128)
LENGTHS = (1, 17, 100, 130)
MASKS = {"causal": (True, None), "full": (False, None), "window": (True, 37), "band": (False, 37)}
TOL = 2e-4


def float64_attention(q, k, v, causal, window):
    """softmax(QKᵀ/√D + mask)V in float64, written out here independently of model code."""
    t = q.shape[-2]
    i = torch.arange(t, device=q.device)[:, None]  # (T, 1) query index
    j = torch.arange(t, device=q.device)[None, :]  # (1, T) key index
    visible = torch.ones(t, t, dtype=torch.bool, device=q.device)  # (T, T)
    if causal:
        visible &= j <= i
    if window is not None:
        visible &= (i - j < window) & (j - i < window)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v  # (B, H, T, D)


def rel_err(x, ref):
    """max |x − ref| / max(max |ref|, 1). Unit-variance inputs give max |ref| ≈ 1–5; the floor only
    matters where the exact gradient is 0 (dQ, dK at T=1) and float32 leaves the rounding of dP − Δ."""
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


def errors_vs_float64(shape, causal, window, impl, dtype=torch.float32, seed=0, device="cpu", deterministic=False):
    """Relative errors of (O, dQ, dK, dV) of `impl` (with `deterministic` passed on) against float64
    autograd on random inputs.

    The inputs are drawn in float64 on the CPU and rounded to `dtype` on `device`; the reference
    runs in float64 (on `device`) on those rounded values, so only the kernel's arithmetic is measured."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(shape, generator=gen, dtype=torch.float64).to(device) for _ in range(4))  # (B, H, T, D)
    ins = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out = attention(*ins, causal=causal, window=window, impl=impl, deterministic=deterministic)
    grads = torch.autograd.grad(out, ins, do.to(dtype))
    ref_ins = [x.detach().double().requires_grad_() for x in ins]
    ref = float64_attention(*ref_ins, causal, window)
    ref_grads = torch.autograd.grad(ref, ref_ins, do.to(dtype).double())
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    return [rel_err(x, r) for x, r in zip((out, *grads), (ref, *ref_grads))]


def packed_errors_vs_float64(b, t, h, d, causal, window, impl, dtype=torch.float32, seed=0, device="cpu",
                             deterministic=False):
    """Relative errors of O and of the fused projection's gradient when q, k, v are the three
    slices of one (B, T, H, 3, D) tensor, as model.layers.SelfAttention cuts them, against float64
    autograd on the same (rounded) values. Returns (errors, output, input) for further checks."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, t, h * 3 * d, generator=gen, dtype=torch.float64)  # (B, T, H·3·D)
    do = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)  # (B, H, T, D)
    qkv = qkv.to(device=device, dtype=dtype).requires_grad_()
    out = attention(*split_heads(qkv, h, d), causal=causal, window=window, impl=impl, deterministic=deterministic)
    (grad,) = torch.autograd.grad(out, qkv, do.to(device=device, dtype=dtype), retain_graph=True)
    ref_qkv = qkv.detach().double().requires_grad_()
    ref = float64_attention(*split_heads(ref_qkv, h, d), causal, window)
    (ref_grad,) = torch.autograd.grad(ref, ref_qkv, do.to(device=device, dtype=dtype).double())
    return [rel_err(out, ref), rel_err(grad, ref_grad)], out, qkv


def split_heads(qkv, h, d):
    """q, k, v (each (B, H, T, D)) as views of a (B, T, H·3·D) projection, the way SelfAttention does."""
    b, t, _ = qkv.shape
    return qkv.view(b, t, h, 3, d).permute(3, 0, 2, 1, 4).unbind(0)


def large_inputs(b, t, d, dtype, seed=0, device="cpu"):
    """q, k, v, dO of shape (B, 2, T, D), drawn in float64 and rounded to `dtype`, with scores far from
    unit size, one kind per head:
      head 0: every query points away from every key (q = −25√D·u + n, k = 6u + n/2 for one unit
              vector u, n standard normal), so every score QKᵀ/√D is about −150 ± 40 and so is each
              row's log-sum-exp: e^(0 − LSE), what a zero key past T gives where it is not masked,
              overflows float32;
      head 1: the magnitudes of FlashAttention's backward-overflow test: q·5, k·3, v·3.
    dO is standard normal."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(b, 2, t, d, generator=gen, dtype=torch.float64) for _ in range(4))  # (B, 2, T, D)
    u = torch.randn(d, generator=gen, dtype=torch.float64)  # (D,)
    u = u / u.norm()
    q = torch.stack([q[:, 0] - 25 * math.sqrt(d) * u, q[:, 1] * 5], 1)  # (B, 2, T, D)
    k = torch.stack([k[:, 0] / 2 + 6 * u, k[:, 1] * 3], 1)  # (B, 2, T, D)
    v = torch.stack([v[:, 0], v[:, 1] * 3], 1)  # (B, 2, T, D)
    return (x.to(device=device, dtype=dtype) for x in (q, k, v, do))


def errors_against_plain(q, k, v, do, causal, window, impl, deterministic=False):
    """Per head, the errors of `impl` and of plain PyTorch in the inputs' own dtype (float64_attention
    on the same tensors, softmax and all in that dtype), both against float64 autograd on the same
    rounded values: {"O", "dQ", "dK", "dV"} → [(impl's error, plain PyTorch's error) per head], each
    max |x − ref| / max(max |ref|, 1) over that head. FlashAttention's tests ask a fused kernel in half
    precision for at most 2× plain PyTorch's error in the same precision."""
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attention(*ins, causal=causal, window=window, impl=impl, deterministic=deterministic)
    got = (out, *torch.autograd.grad(out, ins, do))
    plain_ins = [x.clone().requires_grad_() for x in (q, k, v)]
    plain = float64_attention(*plain_ins, causal, window)
    plain = (plain, *torch.autograd.grad(plain, plain_ins, do))
    ref_ins = [x.double().requires_grad_() for x in (q, k, v)]
    ref = float64_attention(*ref_ins, causal, window)
    ref = (ref, *torch.autograd.grad(ref, ref_ins, do.double()))
    return {name: [(rel_err(x[:, h], r[:, h]), rel_err(p[:, h], r[:, h])) for h in range(q.shape[1])]
            for name, x, p, r in zip(("O", "dQ", "dK", "dV"), got, plain, ref)}
