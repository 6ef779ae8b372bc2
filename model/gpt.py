"""GPT: Embedding → Block × L → Head, held as one flat list of layers.

Layer i of the list is `make_layer(config, i)`: 0 the Embedding, 1 … L the Blocks, L + 1 the Head.
Any part of the list (a pipeline stage) is built and initialised by global index, so the weights
of every part are the one-process model's. The Head's unembedding is the token embedding: its
`lm_head.weight` is layer 0's `wte.weight` (TIED), one Parameter when both live in one model,
drawn from layer 0's seed wherever it lives.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.config import GPTConfig
from model.init import init_layer_, init_parameter_, materialize_
from model.layers import Block, Embedding, Head, lm_loss

# The tied matrix: (layer index, name) of the copy in the Head → of the owner in the Embedding.
TIED_COPY, TIED_OWNER = "lm_head.weight", (0, "wte.weight")
SELECTIVE = "selective"  # the activation_checkpointing mode that recomputes LayerNorm and GELU outputs only


def make_layer(config: GPTConfig, index: int) -> nn.Module:
    """Layer `index` of the flat list (untied, uninitialised): 0 Embedding, 1 … L Block, L + 1 Head."""
    if index == 0:
        return Embedding(config)
    if 1 <= index <= config.n_layer:
        return Block(config, index - 1)
    if index == config.n_layer + 1:
        return Head(config)
    raise IndexError(f"layer {index} of a {config.n_layer}-block GPT: layers are 0 … {config.n_layer + 1}")


def layer_list(config: GPTConfig) -> list[nn.Module]:
    """The model as a flat list: [Embedding, Block_0, …, Block_{L-1}, Head] (untied, uninitialised)."""
    return [make_layer(config, i) for i in range(config.n_layer + 2)]


def tied_names(config: GPTConfig) -> dict[str, str]:
    """Full parameter name of the tied copy → full name of the matrix it is: the unembedding is the
    token embedding. `GPT.named_parameters()` lists only the owner."""
    owner_layer, owner_name = TIED_OWNER
    return {f"layers.{config.n_layer + 1}.{TIED_COPY}": f"layers.{owner_layer}.{owner_name}"}


def init_layers_(layers: dict[int, nn.Module], config: GPTConfig, seed: int) -> None:
    """Layout-invariant GPT-2/3 init (model/init.py) of any part of the layer list, given as
    {index in the full list: layer}. The tied matrix is drawn once, as layer 0's `wte.weight`; a Head
    without the Embedding beside it draws its `lm_head.weight` from that same seed."""
    done: set[int] = set()
    for index, layer in sorted(layers.items()):
        init_layer_(layer, index, seed, config.n_layer, config.init_std, frozenset(done))
        done.update(id(p) for p in layer.parameters())
    head = layers.get(config.n_layer + 1)
    if head is not None and 0 not in layers:
        owner_layer, owner_name = TIED_OWNER
        tied = head.get_parameter(TIED_COPY)
        init_parameter_(tied, owner_layer, owner_name, seed, config.n_layer, config.init_std)


class GPT(nn.Module):
    """A decoder-only transformer; `layers[i]` maps one tensor to the next.

    forward(idx) returns logits (B, T, V); forward(idx, targets) returns the mean cross-entropy;
    forward(idx, cache=KVCache()) encodes only the new tokens idx after those the cache holds.
    Construct under `torch.device("meta")` to get shapes without memory, then `materialize`.
    """

    def __init__(self, config: GPTConfig, layers: list[nn.Module] | None = None):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(layers if layers is not None else layer_list(config))
        self.loss_fn = lm_loss  # (logits, targets) → scalar; tensor parallelism swaps in a vocab-parallel one
        self.activation_checkpointing = 0
        self.tie_weights()

    @property
    def activation_checkpointing(self) -> int | str:
        """0: keep every activation; k > 0: recompute each run of k blocks in backward; "selective":
        every block recomputes its LayerNorm and GELU outputs in backward (see model.layers.Block)."""
        return self._activation_checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, mode: int | str) -> None:
        set_selective_recomputation(self.layers, mode == SELECTIVE)
        self._activation_checkpointing = mode

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
        """Layout-invariant GPT-2/3 init of every layer (see init_layers_)."""
        init_layers_(dict(enumerate(self.layers)), self.config, seed)

    def materialize(self, device: torch.device | str, seed: int) -> "GPT":
        """Allocate storage for a meta-built model on `device` (keeping parameter attributes such as
        sharding hints), re-tie, and initialise."""
        materialize_(self, device)
        self.tie_weights()
        self.init_weights(seed)
        return self

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        seen = 0 if cache is None else cache.seen
        if seen + idx.shape[1] > self.config.seq_len:
            raise ValueError(
                f"sequence of {seen + idx.shape[1]} tokens exceeds model.seq_len={self.config.seq_len}"
            )
        k = self.activation_checkpointing
        if cache is not None:
            x = run_layers(self.layers, idx, cache)
        elif k != SELECTIVE and k and self.training and torch.is_grad_enabled():
            blocks = list(self.layers[1:-1])
            x = self.embedding(idx)  # (B, T, d)
            for start in range(0, len(blocks), k):  # keep only each segment's input; recompute inside
                x = checkpoint(run_layers, blocks[start : start + k], x, use_reentrant=False)
            x = self.head(x)  # (B, T, V)
        else:
            x = run_layers(self.layers, idx)
        return x if targets is None else self.loss_fn(x, targets)


def set_selective_recomputation(layers, on: bool) -> None:
    """Make every Block among `layers` recompute its LayerNorm and GELU outputs in backward (or not)."""
    for layer in layers:
        if isinstance(layer, Block):
            layer.selective_recomputation = on


def run_layers(layers, x: torch.Tensor, cache=None) -> torch.Tensor:
    """x through `layers` in order; with a KVCache, each layer attends to the cached tokens too and
    the cache then counts x's tokens as seen."""
    tokens = x.shape[1]
    for layer in layers:
        x = layer(x) if cache is None else layer(x, cache=cache)
    if cache is not None:
        cache.advance(tokens)
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


def flops_per_token(matmul_params: int, n_layer: int, d_model: int, seq_len: int) -> int:
    """Training FLOPs per token, forward + backward, as PaLM counts them (Chowdhery et al. 2022, App. B):
    6·N + 12·L·d·T, N the parameters without the position table (the tied embedding counted once, for
    the unembedding's matrix multiply; LayerNorm and bias parameters, a rounding error, included),
    L layers, d = d_model, T = seq_len (the attention score and value products)."""
    return 6 * matmul_params + 12 * n_layer * d_model * seq_len
