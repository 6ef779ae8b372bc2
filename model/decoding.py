"""Autoregressive generation from a GPT, with a KV cache (model/kv_cache.py).

Step s feeds the model only the tokens it has not seen (the prompt, then one token at a time);
the cache supplies the keys and values of the rest. The context is the last seq_len tokens, as
without a cache: once the sequence outgrows the position table, every step re-encodes its last
seq_len tokens from a fresh cache, since their positions all shift by one.

Choosing the next token: temperature 0 is greedy (argmax); otherwise logits / temperature,
restricted to the top_k largest when top_k is set, are sampled with `generator`.
"""

from __future__ import annotations

from functools import partial

import torch

from model.gpt import GPT, run_layers
from model.kv_cache import KVCache


def pick_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator=None) -> torch.Tensor:
    """The next token (B, 1) from the last position's logits (B, V)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator)  # (B, 1)


class Decoder:
    """One generation step: the unseen tokens (B, t) and a cache (or None) → the next token (B, 1).

    This one runs a module whose forward(tokens[, cache=]) returns logits (B, t, V); for a GPT it
    runs the layers itself so that only the last position reaches the unembedding. A model split
    over processes supplies its own Decoder (parallel/layout_decoder.py).
    """

    def __init__(self, model: torch.nn.Module):
        self.model, self.config = model, model.config

    def next_token(self, tokens: torch.Tensor, cache: KVCache | None, pick) -> torch.Tensor:
        return pick(self.last_logits(tokens, cache).float())  # (B, 1)

    def last_logits(self, tokens: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """Logits (B, V) of the position after the last token."""
        if isinstance(self.model, GPT):
            hidden = run_layers(self.model.layers[:-1], tokens, cache=cache)  # (B, t, d)
            return self.model.head(hidden[:, -1:])[:, 0]  # (B, V)
        logits = self.model(tokens) if cache is None else self.model(tokens, cache=cache)  # (B, t, V)
        return logits[:, -1, :]


@torch.no_grad()
def generate(
    model,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = 50,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> torch.Tensor:
    """Extend idx (B, T0) by max_new_tokens tokens; temperature 0 means greedy.

    model: a module whose forward(tokens, cache=None) gives logits (B, t, V), or a Decoder.
    use_cache=False re-encodes the whole context every step (the reference the cache must match).
    Runs eager even where the blocks were compiled (model.compile).
    """
    with torch.compiler.set_stance("force_eager"):  # compiled blocks (model.compile) decode eager
        return _generate(model, idx, max_new_tokens, temperature, top_k, generator, use_cache)


def _generate(model, idx, max_new_tokens, temperature, top_k, generator, use_cache) -> torch.Tensor:
    decoder = model if isinstance(model, Decoder) else Decoder(model)
    seq_len = decoder.config.seq_len
    pick = partial(pick_token, temperature=temperature, top_k=top_k, generator=generator)
    cache = KVCache() if use_cache else None
    unseen = idx  # (B, t): tokens the cache has not encoded
    for _ in range(max_new_tokens):
        if cache is None:
            tokens = idx[:, -seq_len:]  # (B, ≤T)
        elif cache.seen + unseen.shape[1] > seq_len:  # the window slides: positions shift, start over
            cache, tokens = KVCache(), idx[:, -seq_len:]
        else:
            tokens = unseen
        next_id = decoder.next_token(tokens, cache, pick)  # (B, 1)
        idx = torch.cat([idx, next_id], dim=1)  # (B, T0 + i + 1)
        unseen = next_id
    return idx
