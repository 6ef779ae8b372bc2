"""The one attention entry point of the model.

attention(q, k, v) = softmax(q kᵀ / √D + mask) v on (B, H, T, D) tensors, where the mask is
−∞ above the diagonal when causal and, with window=w, also for keys more than w−1 positions
behind the query (query t sees keys in (t−w, t]).
"""

from __future__ import annotations

import math

import torch


def attention(q, k, v, causal: bool = True, window: int | None = None, impl: str = "auto"):
    """Scaled dot-product attention; q, k, v: (B, H, T, D). Returns (B, H, T, D)."""
    return reference_attention(q, k, v, causal=causal, window=window)


def band_mask(t_q: int, t_k: int, causal: bool, window: int | None, device) -> torch.Tensor | None:
    """Boolean (t_q, t_k) mask, True where a query may attend; None when nothing is masked."""
    if not causal and window is None:
        return None
    qi = torch.arange(t_q, device=device)[:, None]  # (Tq, 1)
    kj = torch.arange(t_k, device=device)[None, :]  # (1, Tk)
    allowed = torch.ones(t_q, t_k, dtype=torch.bool, device=device)
    if causal:
        allowed &= kj <= qi
    if window is not None:
        allowed &= (qi - kj) < window
        if not causal:
            allowed &= (kj - qi) < window
    return allowed


def reference_attention(q, k, v, causal: bool = True, window: int | None = None):
    """Plain softmax(QKᵀ/√D)V with autograd: materialises the (T, T) scores."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    mask = band_mask(q.shape[-2], k.shape[-2], causal, window, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # (B, H, T, T)
    return probs @ v  # (B, H, T, D)
