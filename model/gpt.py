"""GPT: Embedding → Block × L → Head, held as one flat list of layers.

Layer i of the list is `make_layer(config, i)`: 0 the Embedding, 1 … L the Blocks, L + 1 the Head.
Any part of the list (a pipeline stage) is built and initialised by global index, so the weights
of every part are the one-process model's. The Head's unembedding is the token embedding: its
`lm_head.weight` is layer 0's `wte.weight` (TIED), one Parameter when both live in one model,
drawn from layer 0's seed wherever it lives.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.config import GPTConfig
from model.init import init_layer_, init_parameter_, materialize_
from model.layers import Block, Embedding, Head
from model.modes import LayerModes

# The tied matrix: (layer index, name) of the copy in the Head → of the owner in the Embedding.
TIED_COPY, TIED_OWNER = "lm_head.weight", (0, "wte.weight")


def layer_type(config: GPTConfig, index: int) -> type[nn.Module]:
    """The class of layer `index` of the flat list: 0 Embedding, 1 … L Block, L + 1 Head."""
    if index == 0:
        return Embedding
    if 1 <= index <= config.n_layer:
        return Block
    if index == config.n_layer + 1:
        return Head
    raise IndexError(f"layer {index} of a {config.n_layer}-block GPT: layers are 0 … {config.n_layer + 1}")


def make_layer(config: GPTConfig, index: int, modes: LayerModes = LayerModes()) -> nn.Module:
    """Layer `index` of the flat list (untied, uninitialised), built in `modes` (classes: `layer_type`)."""
    kind = layer_type(config, index)
    if kind is Embedding:
        return Embedding(config)
    if kind is Block:
        return Block(config, index - 1, selective_recomputation=modes.selective, fp8=modes.fp8,
                     weight_grads=modes.weight_grads, fp8_linears=modes.fp8_linears)
    return Head(config, fused_loss=modes.fused_loss)


def layer_list(config: GPTConfig, modes: LayerModes = LayerModes()) -> list[nn.Module]:
    """The model as a flat list: [Embedding, Block_0, …, Block_{L-1}, Head] (untied, uninitialised)."""
    return [make_layer(config, i, modes) for i in range(config.n_layer + 2)]


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

    forward(idx) returns logits (B, T, V); forward(idx, targets) the mean cross-entropy, computed by
    the Head (model.layers.Head), in the loss mode it was built with; forward(idx, cache=KVCache())
    encodes only the new tokens idx after those the cache holds. `checkpoint_every` = k > 0
    recomputes each run of k blocks in backward (LayerModes.checkpoint_every). Construct under
    `torch.device("meta")` to get shapes without memory, then `materialize`.
    """

    def __init__(self, config: GPTConfig, layers: list[nn.Module] | None = None, modes: LayerModes = LayerModes()):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(layers if layers is not None else layer_list(config, modes))
        self.checkpoint_every = modes.checkpoint_every
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
        every = self.checkpoint_every if self.training else 0
        return run_layers(self.layers, idx, targets, cache, every)  # (B, T, V) logits, or the loss


def run_layers(layers, x: torch.Tensor, targets: torch.Tensor | None = None, cache=None,
               checkpoint_every: int = 0) -> torch.Tensor:
    """x through `layers` in order (the whole flat list, or a pipeline stage's run of it). A Head
    among them gets `targets` (and then returns the loss). With checkpoint_every = k > 0 and gradients
    on, each run of up to k consecutive Blocks keeps only its input and recomputes inside in backward.
    With a KVCache each layer also attends to the cached tokens, and the cache then counts x's tokens."""
    tokens = x.shape[1]
    every = checkpoint_every if cache is None and torch.is_grad_enabled() else 0
    for part in _segments(layers, every):
        if isinstance(part, list):  # keep only the segment's input; recompute inside
            x = checkpoint(_run_blocks, part, x, use_reentrant=False)  # (B, T, d)
        elif isinstance(part, Head):
            x = part(x, targets, cache=cache)  # (B, T, V) logits, or the loss
        else:
            x = part(x) if cache is None else part(x, cache=cache)  # (B, T, d)
    if cache is not None:
        cache.advance(tokens)
    return x


def _segments(layers, every: int) -> list:
    """The layers in order, each run of up to `every` consecutive Blocks grouped into a list (0: none)."""
    parts: list = []
    for layer in layers:
        if not (every and isinstance(layer, Block)):
            parts.append(layer)
        elif parts and isinstance(parts[-1], list) and len(parts[-1]) < every:
            parts[-1].append(layer)
        else:
            parts.append([layer])
    return parts


def _run_blocks(blocks: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)  # (B, T, d)
    return x


def build(config: GPTConfig, device: torch.device | str = "cpu", seed: int = 0, modes: LayerModes = LayerModes()) -> GPT:
    """Build and initialise a GPT in `modes` on `device` (built on meta first, so nothing is allocated twice)."""
    with torch.device("meta"):
        model = GPT(config, modes=modes)
    return model.materialize(device, seed)


def count_parameters(model: nn.Module, exclude_positions: bool = False) -> int:
    """Unique parameters of the full model (tied matrices once; a parameter that announces its
    `full_shape`, such as the padded vocabulary's, counts as that tensor: V rows, not Vp);
    optionally without the position table."""
    total = sum(math.prod(getattr(p, "full_shape", p.shape)) for p in model.parameters())
    if exclude_positions:
        total -= sum(p.numel() for n, p in model.named_parameters() if n.endswith("wpe.weight"))
    return total


def flops_per_token(matmul_params: int, n_layer: int, d_model: int, seq_len: int) -> int:
    """Training FLOPs per token, forward + backward, as PaLM counts them (Chowdhery et al. 2022, App. B):
    6·N + 12·L·d·T, N the parameters without the position table (the tied embedding counted once, for
    the unembedding's matrix multiply; LayerNorm and bias parameters, a rounding error, included),
    L layers, d = d_model, T = seq_len (the attention score and value products)."""
    return 6 * matmul_params + 12 * n_layer * d_model * seq_len
