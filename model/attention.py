"""The one attention entry point of the model.

attention(q, k, v) = softmax(q kᵀ / √D + mask) v on (B, H, T, D) tensors, where the mask is
−∞ above the diagonal when causal and, with window=w, also for keys more than w−1 positions
behind the query (query t sees keys in (t−w, t]).

Every mask used here is a band on the offset j − i between key j and query i:
key j is visible to query i iff lo ≤ j − i ≤ hi (see `band_limits`). The fused implementations
take (lo, hi) and nothing else, so causal, banded and dense attention are one code path.

Implementations (`impl`):
  "triton"     the fused FlashAttention-2 kernel, forward and backward (model/attention_triton.py)
  "torch"      the same tiled math in torch ops, for CPU (model/attention_torch.py)
  "sdpa"       torch.nn.functional.scaled_dot_product_attention: is_causal for dense causal
               layers, the band as a boolean mask otherwise; PyTorch picks its backend (FlashAttention,
               cuDNN, memory-efficient, math). A fallback, and the baseline the kernel is measured against.
  "reference"  plain softmax(QKᵀ/√D)V with autograd; materialises the (T, T) scores
  "auto"       "triton" for bf16/fp16 CUDA tensors, "sdpa" for other CUDA tensors (float32: the
               kernel takes half precision only), "torch" on the CPU

A block's attention enters through `packed_attention`, on the QKV projection's packed output: "triton"
and "torch" then run as torch.library custom ops (model/attention_op.py) that read q, k, v in place and
return the heads merged, eager and under torch.compile alike (the compiler treats each as one call with
its own backward). `attention` takes q, k, v apart, as the KV cache and the benchmarks hold them.

deterministic=True asks for gradients that are the same bits on every run. "triton" then computes
dQ in a pass of its own instead of with atomic adds (model/attention_triton.py); "torch" and
"reference" are deterministic already (each output element is summed in a fixed order by torch
ops on one device), so the flag changes nothing there. "sdpa" leaves the choice of backward to
PyTorch, whose fused backends are not all deterministic: it refuses the flag rather than ignore it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from model import attention_torch
from model.config import ATTENTION_IMPLS


def attention(q, k, v, causal: bool = True, window: int | None = None, impl: str = "auto",
              deterministic: bool = False):
    """Scaled dot-product attention; q, k, v: (B, H, T, D). Returns (B, H, T, D)."""
    if q.dim() != 4 or q.shape[-1] < 1:
        raise ValueError(f"attention q of shape {tuple(q.shape)}: must be 4-d (B, H, T, D) with head dim D ≥ 1")
    impl = _resolved_impl(q, causal, window, impl, deterministic)
    if impl == "reference":
        return reference_attention(q, k, v, causal=causal, window=window)
    if impl == "sdpa":
        return sdpa_attention(q, k, v, causal=causal, window=window)
    lo, hi = band_limits(q.shape[-2], causal, window)
    if impl == "torch":
        return attention_torch.banded_attention(q, k, v, lo, hi)
    from model import attention_triton  # triton is imported only when the kernel is used

    return attention_triton.banded_attention(q, k, v, lo, hi, deterministic=deterministic)


def packed_attention(qkv: torch.Tensor, head_dim: int, causal: bool = True, window: int | None = None,
                     impl: str = "auto", deterministic: bool = False) -> torch.Tensor:
    """The same attention on a QKV projection's output qkv (B, T, H·3·D), its rows ordered (head, {q, k, v},
    d_head): returns (B, T, H·D), the heads merged, as the output projection reads them. "triton" and "torch"
    read q, k, v in place and write the merged heads (model/attention_op.py); the others unpack and merge."""
    if qkv.dim() != 3 or head_dim < 1 or qkv.shape[-1] % (3 * head_dim):
        raise ValueError(f"attention qkv of shape {tuple(qkv.shape)} with head dim {head_dim}: must be 3-d (B, T, H·3·D) "
                         f"with D ≥ 1 dividing its last dimension by 3·D")
    b, t, width = qkv.shape
    heads = width // (3 * head_dim)
    impl = _resolved_impl(qkv, causal, window, impl, deterministic)
    if impl in ("triton", "torch"):
        from model.attention_op import attention_forward

        lo, hi = band_limits(t, causal, window)
        return attention_forward(qkv, head_dim, lo, hi, impl, deterministic)[0]  # (B, T, H·D)
    q, k, v = qkv.view(b, t, heads, 3, head_dim).permute(3, 0, 2, 1, 4).unbind(0)  # each (B, H, T, D)
    y = attention(q, k, v, causal=causal, window=window, impl=impl, deterministic=deterministic)  # (B, H, T, D)
    return y.transpose(1, 2).reshape(b, t, heads * head_dim)  # (B, T, H·D)


def _resolved_impl(x: torch.Tensor, causal: bool, window: int | None, impl: str, deterministic: bool) -> str:
    """impl checked against its choices, causal and the window checked, "auto" resolved for x's device and dtype."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl={impl!r}: must be one of {list(ATTENTION_IMPLS)}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"attention window={window!r}: must be None or a positive integer")
    if not isinstance(causal, bool):
        raise ValueError(f"attention causal={causal!r}: must be True or False")
    if impl == "auto":
        impl = "torch" if not x.is_cuda else "triton" if x.dtype in (torch.bfloat16, torch.float16) else "sdpa"
    if deterministic and impl == "sdpa":
        raise ValueError(f"attention deterministic=True with impl='sdpa' (for {x.dtype} on {x.device}): PyTorch's "
                         "SDPA backward is not deterministic on every backend; use impl='triton' with bf16/fp16 "
                         "inputs, or impl='torch'")
    return impl


def band_limits(t: int, causal: bool, window: int | None) -> tuple[int, int]:
    """(lo, hi) such that key j is visible to query i iff lo ≤ j − i ≤ hi, in sequences of length ≤ t.

    causal → hi = 0; window w → lo = −(w−1) (and hi = w−1 when not causal); otherwise ±t, which
    no offset in a length-t sequence reaches.
    """
    lo = -(window - 1) if window is not None else -t
    if causal:
        hi = 0
    else:
        hi = window - 1 if window is not None else t
    return lo, hi


def band_mask(t_q: int, t_k: int, causal: bool, window: int | None, device) -> torch.Tensor | None:
    """Boolean (t_q, t_k) mask, True where a query may attend; None when nothing is masked."""
    if not causal and window is None:
        return None
    lo, hi = band_limits(max(t_q, t_k), causal, window)
    qi = torch.arange(t_q, device=device)[:, None]  # (Tq, 1)
    kj = torch.arange(t_k, device=device)[None, :]  # (1, Tk)
    offset = kj - qi  # (Tq, Tk)
    return (offset >= lo) & (offset <= hi)


def sdpa_attention(q, k, v, causal: bool = True, window: int | None = None):
    """PyTorch's fused attention with the same mask: is_causal when only causal, else the band as a
    boolean (T, T) mask (True = attend), which rules out the FlashAttention backend."""
    t = q.shape[-2]
    if window is None or window >= t:  # a window as long as the sequence masks nothing more
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, H, T, D)
    mask = band_mask(t, t, causal, window, q.device)  # (T, T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, D)


def reference_attention(q, k, v, causal: bool = True, window: int | None = None):
    """Plain softmax(QKᵀ/√D)V with autograd: materialises the (T, T) scores."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    mask = band_mask(q.shape[-2], k.shape[-2], causal, window, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # half precision upcast, float64 kept
    probs = torch.softmax(scores.to(softmax_dtype), dim=-1).to(q.dtype)  # (B, H, T, T)
    return probs @ v  # (B, H, T, D)
