"""GPT: Embedding → Block × L → Head, held as one flat list of layers."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.config import GPTConfig
from model.init import init_layer_, materialize_
from model.layers import Block, Embedding, Head, lm_loss


def layer_list(config: GPTConfig) -> list[nn.Module]:
    """The model as a flat list: [Embedding, Block_0, …, Block_{L-1}, Head] (untied, uninitialised)."""
    return [Embedding(config), *(Block(config, i) for i in range(config.n_layer)), Head(config)]


class GPT(nn.Module):
    """A decoder-only transformer; `layers[i]` maps one tensor to the next.

    forward(idx) returns logits (B, T, V); forward(idx, targets) returns the mean cross-entropy.
    Construct under `torch.device("meta")` to get shapes without memory, then `materialize`.
    """

    def __init__(self, config: GPTConfig, layers: list[nn.Module] | None = None):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(layers if layers is not None else layer_list(config))
        self.loss_fn = lm_loss  # (logits, targets) → scalar; tensor parallelism swaps in a vocab-parallel one
        self.activation_checkpointing = 0  # k > 0: recompute each run of k blocks in backward
        self.tie_weights()

    @property
    def embedding(self) -> Embedding:
        return self.layers[0]

    @property
    def head(self) -> Head:
        return self.layers[-1]

    def tie_weights(self) -> None:
        """Share one matrix between the token embedding and the unembedding."""
        self.head.lm_head.weight = self.embedding.wte.weight

    def init_weights(self, seed: int) -> None:
        """Layout-invariant GPT-2/3 init: see model/init.py. The tied matrix is drawn once, as
        layer 0's `wte.weight`, so a pipeline stage holding only the embedding draws the same."""
        done: set[int] = set()
        for index, layer in enumerate(self.layers):
            init_layer_(layer, index, seed, self.config.n_layer, self.config.init_std, frozenset(done))
            done.update(id(p) for p in layer.parameters())

    def materialize(self, device: torch.device | str, seed: int) -> "GPT":
        """Allocate storage for a meta-built model on `device` (keeping parameter attributes such as
        sharding hints), re-tie, and initialise."""
        materialize_(self, device)
        self.tie_weights()
        self.init_weights(seed)
        return self

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if idx.shape[1] > self.config.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens exceeds model.seq_len={self.config.seq_len}")
        k = self.activation_checkpointing
        if k and self.training and torch.is_grad_enabled():
            blocks = list(self.layers[1:-1])
            x = self.embedding(idx)  # (B, T, d)
            for start in range(0, len(blocks), k):  # keep only each segment's input; recompute inside
                x = checkpoint(_run_layers, blocks[start : start + k], x, use_reentrant=False)
            x = self.head(x)  # (B, T, V)
        else:
            x = _run_layers(self.layers, idx)
        return x if targets is None else self.loss_fn(x, targets)


def _run_layers(layers, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def build(config: GPTConfig, device: torch.device | str = "cpu", seed: int = 0) -> GPT:
    """Build and initialise a GPT on `device` (built on meta first, so nothing is allocated twice)."""
    with torch.device("meta"):
        model = GPT(config)
    return model.materialize(device, seed)


def count_parameters(model: nn.Module, exclude_positions: bool = False) -> int:
    """Unique parameters (tied matrices once); optionally without the position table."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_positions:
        total -= sum(p.numel() for n, p in model.named_parameters() if n.endswith("wpe.weight"))
    return total
