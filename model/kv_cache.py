"""Keys and values of the tokens a GPT has already seen, so generation encodes each token once.

Without a cache every generated token re-encodes the whole context: O(T²) work per sequence for
the projections and MLPs, O(T³) for attention. With one, a step runs the layers on the new
tokens only: each attention layer appends their keys and values to its cache and attends from
their queries to everything it holds.

Token positions are absolute: the cache has seen `seen` tokens, so new token i sits at position
seen + i. A dense layer keeps every key; a banded layer of window w (query p sees keys in
(p − w, p]) keeps only the last w − 1, all a later query can reach. The cache holds whatever heads
the layer computes, so a tensor-parallel layer caches only its own heads and nothing here knows
about parallelism.

Cached attention, for new queries q (positions seen … seen + t − 1) and kept keys K (positions
seen − n … seen + t − 1, the last t of them new): S = q Kᵀ/√D with −∞ where key position > query
position or ≤ query position − w; out = softmax(S) V. It is plain torch (it materialises the
(t, n + t) scores, small when t = 1); a step with nothing cached uses the model's own attention.
"""

from __future__ import annotations

import math

import torch

from model.attention import attention


class KVCache:
    """Per attention layer (keyed by block index): keys and values (B, H, n, D) of past tokens."""

    def __init__(self):
        self.seen = 0  # tokens encoded so far; the next new token sits at this position
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def advance(self, tokens: int) -> None:
        """Count `tokens` more tokens as seen (once per forward over the layers, after them)."""
        self.seen += tokens

    def attend(self, layer: int, q, k, v, window: int | None, impl: str = "auto") -> torch.Tensor:
        """Attention of the new tokens' queries (B, H, t, D) over the cached and the new keys and
        values of block `layer`; stores what later tokens need. Returns (B, H, t, D)."""
        if layer not in self.keys:  # nothing cached yet: ordinary causal (banded) attention
            out = attention(q, k, v, causal=True, window=window, impl=impl)  # (B, H, t, D)
            keys, values = k, v
        else:
            keys = torch.cat([self.keys[layer], k], dim=-2)  # (B, H, n + t, D)
            values = torch.cat([self.values[layer], v], dim=-2)  # (B, H, n + t, D)
            out = cached_attention(q, keys, values, window)  # (B, H, t, D)
        keep = keys.shape[-2] if window is None else min(keys.shape[-2], window - 1)
        self.keys[layer] = keys[..., keys.shape[-2] - keep :, :]  # (B, H, keep, D)
        self.values[layer] = values[..., values.shape[-2] - keep :, :]  # (B, H, keep, D)
        return out

    def select(self, rows: torch.Tensor) -> None:
        """Keep the cached keys and values of batch rows `rows` (R,), in that order; a row may repeat,
        so R sequences continue from one encoded prefix each (several endings of one shared context)."""
        for layer in self.keys:
            self.keys[layer] = self.keys[layer].index_select(0, rows)  # (R, H, n, D)
            self.values[layer] = self.values[layer].index_select(0, rows)  # (R, H, n, D)

    def held(self, layer: int) -> int:
        """How many tokens' keys block `layer` keeps."""
        return self.keys[layer].shape[-2] if layer in self.keys else 0


def cached_attention(q, keys, values, window: int | None) -> torch.Tensor:
    """softmax(q Kᵀ/√D + mask) V where the t queries are the last t of the n + t key positions.

    q (B, H, t, D), keys/values (B, H, n + t, D). Query i sits at key position n + i and sees key j
    iff j ≤ n + i and, with a window w, j > n + i − w.
    """
    t, total = q.shape[-2], keys.shape[-2]
    scores = (q @ keys.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, t, n + t)
    query_pos = torch.arange(total - t, total, device=q.device)[:, None]  # (t, 1)
    key_pos = torch.arange(total, device=q.device)[None, :]  # (1, n + t)
    visible = key_pos <= query_pos  # (t, n + t)
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # half precision upcast, float64 kept
    probs = torch.softmax(scores.to(softmax_dtype), dim=-1).to(q.dtype)  # (B, H, t, n + t)
    return probs @ values  # (B, H, t, D)
