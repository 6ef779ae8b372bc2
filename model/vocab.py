"""The vocabulary padded for the GPU: token embedding and unembedding hold Vp ≥ V rows.

A (N, d) × (d, V) matrix multiply with V = 50257 (GPT-2's vocabulary, an odd number) leaves the
GPU's tensor cores partly idle; padding the matrix to Vp = a multiple of 128 rows (50304) makes
every tile whole. Rows V … Vp − 1 are padding: zero, never looked up (token ids are < V), their
logit columns cut off before any softmax (PaddedUnembedding returns only the first V), so their
gradients are exactly zero and they stay zero under AdamW (decay of zero is zero).

The weight announces the unpadded tensor as tensor parallelism's shards do (model/init.py):
`full_shape` (V, d) is what init draws, checkpoints name and export writes, and `shard_of`
pads a full (V, d) tensor to the local (Vp, d). With tp > 1 parallel/tensor.py pads further, to
a multiple of 128·tp, and splits the rows over the ranks.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from model.fused_loss import fused_linear_cross_entropy
from model.modes import Fixed

VOCAB_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tp: int = 1) -> int:
    """vocab_size rounded up to a multiple of 128·tp: aligned GEMM tiles, and with tp > 1 an equal,
    aligned shard on every rank (50257 → 50304 at tp = 1 or 2, 50688 at tp = 4)."""
    step = VOCAB_MULTIPLE * tp
    return -(-vocab_size // step) * step


def pad_rows(full: torch.Tensor, rows: int) -> torch.Tensor:
    """full (V, …) followed by zero rows up to `rows`: (rows, …)."""
    padded = full.new_zeros(rows, *full.shape[1:])
    padded[: full.shape[0]] = full
    return padded


def _mark_padded(weight: nn.Parameter, vocab_size: int) -> None:
    weight.full_shape = (vocab_size, *weight.shape[1:])
    weight.shard_of = partial(pad_rows, rows=weight.shape[0])


class PaddedEmbedding(nn.Embedding):
    """Token embedding E (Vp, d) of which rows < vocab_size are the vocabulary's: ids (B, T) → (B, T, d)."""

    def __init__(self, vocab_size: int, embedding_dim: int, device=None, dtype=None):
        super().__init__(padded_vocab_size(vocab_size), embedding_dim, device=device, dtype=dtype)
        self.vocab_size = vocab_size
        _mark_padded(self.weight, vocab_size)


class PaddedUnembedding(nn.Linear):
    """Logits h Eᵀ over the real vocabulary: (B, T, d) → (B, T, V), computed with the padded E (Vp, d)
    (normally the embedding's own weight) and its padding columns dropped, so nothing downstream
    (loss, sampling) ever sees them.

    `loss(h, targets)` is the mean next-token cross-entropy, in the mode fixed at construction: with
    `fused_loss`, without making all the logits at once (model/fused_loss.py), else from the logits
    (lm_loss). Both run inside the calling Head's forward, so whatever wraps the model's forward (ZeRO-3
    gathering the weight, DeepSpeed's backward hooks on its output) sees the loss's use of the weight."""

    fused_loss = Fixed()

    def __init__(self, in_features: int, vocab_size: int, device=None, dtype=None, fused_loss: bool = False):
        super().__init__(in_features, padded_vocab_size(vocab_size), bias=False, device=device, dtype=dtype)
        self.vocab_size, self.fused_loss = vocab_size, fused_loss
        _mark_padded(self.weight, vocab_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight)[..., : self.vocab_size]  # (B, T, Vp) → (B, T, V)

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the logits of h (B, T, d) against targets (B, T)."""
        if self.fused_loss:
            return fused_linear_cross_entropy(h, self.weight, targets, self.vocab_size)
        return lm_loss(self(h), targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
