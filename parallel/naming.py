"""Every layout names parameters the same way: as slices of the one-process model's tensors.

The full model's parameters are named as `model.GPT(config).named_parameters()` names them:
"layers.{i}.{name}" for layer i of the flat list (0 Embedding, 1 … L Blocks, L + 1 Head), e.g.
"layers.3.attn.qkv.weight"; the tied matrix once, as "layers.0.wte.weight". A rank's parameter is
a Shard of one of them:

    name         the full parameter's name
    full_shape   its shape
    split_dim    the dimension cut over the tp ranks, or None: every tp rank holds all of it
                 (LayerNorm γ/β, sequence-parallel ones included; row-parallel biases; positions)
    index        the region of the full tensor this rank holds, one slice per dimension
    local_index  where that region lies in the local tensor; the rest of the local tensor is
                 padding (the vocabulary is padded to a multiple of 128·tp at every tp, so the
                 last shards of the embedding carry zero rows, or only zero rows, beyond the
                 vocabulary; at tp = 1 the one whole (V, d) sits in a local (Vp, d))
    local_shape  the local tensor's shape
    tied         a copy of the tied matrix: the Head's "lm_head.weight" (the last pipeline
                 stage's own copy, or the one-process model's second name for the shared matrix)

so that  local[local_index] == full[index]  for every parameter, at every layout. Local names are
those of this rank's part: "layers.3.attn.qkv.weight" in a GPT (pp = 1), "3.attn.qkv.weight" in a
pipeline stage. `layer_shards` is a pure function of (config, layer, tp, tp rank): a checkpoint
written at one layout can be read at another without the processes that wrote it.

Example, GPTConfig(vocab_size=300, d_model=32, n_layer=2), tp = 2, tp rank 1, one stage:

    parameter_map(model, config, topology)["layers.0.wte.weight"]
      = Shard(name="layers.0.wte.weight", full_shape=(300, 32), split_dim=0,
              index=(slice(256, 300), slice(0, 32)), local_index=(slice(0, 44), slice(0, 32)),
              local_shape=(256, 32), tied=False)          # rows 44 … 255 of the local tensor: padding
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from model import GPTConfig
from model.gpt import make_layer, tied_names
from parallel.tensor import SPLIT_DIMS, TP_PLAN, padded_vocab_size, plan_style, shard_range


@dataclass(frozen=True)
class Shard:
    """Where a local parameter sits in the full model (see the module docstring)."""

    name: str
    full_shape: tuple[int, ...]
    split_dim: int | None
    index: tuple[slice, ...]
    local_index: tuple[slice, ...]
    local_shape: tuple[int, ...]
    tied: bool = False

    @property
    def replicated(self) -> bool:
        """Every tp rank holds the same values: one of them (tp rank 0) speaks for all."""
        return self.split_dim is None


def layer_shards(config: GPTConfig, layer: int, tp: int = 1, tp_rank: int = 0, plan: dict = TP_PLAN) -> dict[str, Shard]:
    """{parameter name within layer `layer` of the flat list: Shard} for tp rank `tp_rank` of `tp`."""
    return dict(_layer_shards(config, layer, tp, tp_rank, tuple(plan.items())))


@lru_cache(maxsize=512)
def _layer_shards(config: GPTConfig, layer, tp: int, tp_rank: int, plan_items) -> tuple[tuple[str, Shard], ...]:
    plan, tied = dict(plan_items), tied_names(config)
    with torch.device("meta"):
        module = make_layer(config, layer)
    shards = []
    for name, param in module.named_parameters():
        owner, _, kind = name.rpartition(".")
        full_name = f"layers.{layer}.{name}"
        style = plan_style(plan, f"layers.{layer}.{owner}") if tp > 1 else None
        dim = SPLIT_DIMS.get(style, {}).get(kind)
        shape = tuple(getattr(param, "full_shape", param.shape))  # the padded vocabulary's: (V, d)
        index, local_index, local_shape = [slice(0, n) for n in shape], [slice(0, n) for n in shape], list(param.shape)
        if dim is not None:
            padded = padded_vocab_size(shape[dim], tp) if style == "vocab" else None
            start, stop, local = shard_range(shape[dim], tp_rank, tp, padded)
            index[dim], local_index[dim], local_shape[dim] = slice(start, stop), slice(0, stop - start), local
        shard = Shard(tied.get(full_name, full_name), shape, dim, tuple(index), tuple(local_index), tuple(local_shape),
                      tied=full_name in tied)
        shards.append((name, shard))
    return tuple(shards)


def split_local_name(local_name: str) -> tuple[int, str]:
    """(layer index, name within the layer) of a local parameter name of either kind of part."""
    rest = local_name.removeprefix("layers.")
    layer, _, name = rest.partition(".")
    if not layer.isdigit() or not name:
        raise ValueError(f"{local_name!r} is not a parameter of the layer list ('layers.<i>.<name>' or '<i>.<name>')")
    return int(layer), name


def parameter_map(part: nn.Module, config: GPTConfig, topology) -> dict[str, Shard]:
    """{local name: Shard} for every parameter of this rank's part (a GPT or PipelineStages),
    both names of the one-process model's tied matrix included; each local shape is checked."""
    shards = {}
    for local_name, param in part.named_parameters(remove_duplicate=False):
        shard = full_name_and_slice(local_name, config, topology)
        shape = tuple(getattr(param, "ds_shape", param.shape))  # ZeRO-3 keeps the shape of a partitioned one
        if shape != shard.local_shape:
            raise ValueError(f"{local_name}: local shape {shape}, expected {shard.local_shape} for {shard}")
        shards[local_name] = shard
    return shards


def full_name_and_slice(local_name: str, config: GPTConfig, topology) -> Shard:
    """The Shard of one local parameter name on this rank (its tp coordinate in `topology`)."""
    layer, name = split_local_name(local_name)
    shards = layer_shards(config, layer, topology.tp_size, topology.tp_rank)
    if name not in shards:
        raise KeyError(f"{local_name!r}: layer {layer} has no parameter {name!r}; it has {sorted(shards)}")
    return shards[name]


def full_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """{full name: shape} of every parameter of the full model (the tied matrix once)."""
    return {
        shard.name: shard.full_shape
        for layer in range(config.n_layer + 2)
        for shard in layer_shards(config, layer).values()
        if not shard.tied
    }


@torch.no_grad()
def load_full_(part: nn.Module, full: dict[str, torch.Tensor], config: GPTConfig, topology) -> None:
    """Fill this rank's parameters from full tensors {full name: tensor}: each takes its slice,
    vocabulary padding becomes zero. A missing tensor or one of another shape fails, naming it."""
    for local_name, shard in parameter_map(part, config, topology).items():
        if shard.name not in full:
            raise KeyError(f"no tensor {shard.name!r} (for {local_name}) among the {len(full)} given")
        source = full[shard.name]
        if tuple(source.shape) != shard.full_shape:
            raise ValueError(f"{shard.name}: given shape {tuple(source.shape)}, the model's is {shard.full_shape}")
        param = part.get_parameter(local_name)
        param.zero_()
        param[shard.local_index] = source[shard.index].to(param.dtype)
