"""Autoregressive sampling from a GPT (no KV cache: the context is re-encoded each step)."""

from __future__ import annotations

import torch


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = 50,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend idx (B, T0) by max_new_tokens sampled tokens; temperature 0 means greedy."""
    seq_len = model.config.seq_len
    for _ in range(max_new_tokens):
        context = idx[:, -seq_len:]  # (B, ≤T)
        logits = model(context)[:, -1, :].float()  # (B, V)
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)  # (B, V)
            next_id = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
        idx = torch.cat([idx, next_id], dim=1)  # (B, T0 + i + 1)
    return idx
