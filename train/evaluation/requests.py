"""Requests in tokens: (context, continuation) text → (context ids, continuation ids) the model can take.

Encoding follows lm-eval's rule, so both score the same tokens: trailing spaces of the context move
to the front of the continuation; the whole text and the context are encoded with the GPT-2 BPE and
the continuation is what the whole text has beyond the context's tokens; an empty context becomes
<|endoftext|>. The model sees at most seq_len tokens, and scoring a continuation of n tokens takes
the context and the first n − 1 of them as input; a longer request keeps its last seq_len + 1 tokens
(the context truncated from the left) and is counted. A continuation that alone fills the window
keeps its last seq_len tokens behind one token of context.
"""

from __future__ import annotations

from dataclasses import dataclass

from train.data.tokenizer import EOT, gpt2

Tokens = tuple[int, ...]


@dataclass(frozen=True)
class TokenRequest:
    context: Tokens  # ≥ 1 token
    continuation: Tokens  # ≥ 1 token; len(context) + len(continuation) ≤ seq_len + 1


def encode(context: str, continuation: str) -> tuple[Tokens, Tokens]:
    """lm-eval's split of a request into context and continuation tokens (see the module docstring)."""
    encoder = gpt2()
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        return (EOT,), tuple(encoder.encode_ordinary(continuation))
    whole = encoder.encode_ordinary(context + continuation)
    head = encoder.encode_ordinary(context)
    return tuple(head), tuple(whole[len(head) :])


def fit(context: Tokens, continuation: Tokens, seq_len: int) -> tuple[TokenRequest, bool]:
    """The request within the model's window, and whether it had to be cut (see the module docstring)."""
    if len(context) + len(continuation) <= seq_len + 1:
        return TokenRequest(context, continuation), False
    tokens = (context + continuation)[-(seq_len + 1) :]
    kept = min(len(continuation), seq_len)
    return TokenRequest(tokens[: len(tokens) - kept], tokens[len(tokens) - kept :]), True


def tokenize(requests, seq_len: int) -> tuple[list[TokenRequest], int]:
    """Text requests (context, continuation) → TokenRequests, and how many were truncated."""
    out, truncated = [], 0
    for context, continuation in requests:
        request, cut = fit(*encode(context, continuation), seq_len)
        if not request.continuation:
            raise ValueError(f"the continuation {continuation!r} encodes to no token")
        out.append(request)
        truncated += cut
    return out, truncated
