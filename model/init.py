"""Layout-invariant initialisation (GPT-2/3 scheme).

Every parameter is drawn as its *full* tensor from a generator seeded by (seed, layer index,
parameter name), then cut to the local shard, so the same seed gives the same full weights
whatever the tensor/pipeline layout and whichever parameters a rank holds. A sharded parameter
announces itself with two attributes set by whoever sharded it:
  p.full_shape: the unsharded shape to draw
  p.shard_of:   a function mapping the full tensor to this rank's piece
Scheme: weights ~ N(0, std²); residual output projections (attn.proj, mlp.proj) ~ N(0, std²/(2L));
biases 0; LayerNorm γ=1, β=0.

The full tensors are drawn on the parameter's own device, with a generator of that device: on a GPU
a stage of GPT-3 175B (about 11G values) is drawn in well under a second, where the CPU's generator
took minutes. Every rank of a run draws the same full tensors (its GPUs are one model), so layouts
stay equal. CUDA's generator is not the CPU's, and its stream depends on the GPU's number of
multiprocessors: one seed starts a CPU run and a GPU run, or runs on two GPU models, from different
(equally distributed) weights. Checkpoints hold the weights themselves, so a resume never redraws.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

RESIDUAL_PROJECTIONS = ("attn.proj.weight", "mlp.proj.weight")


def parameter_seed(seed: int, layer_index: int, name: str) -> int:
    """A stable 63-bit seed for one parameter, independent of process, order and layout."""
    return ((zlib.crc32(f"{layer_index}/{name}".encode()) << 31) ^ seed) & (2**63 - 1)


def init_layer_(
    layer: nn.Module, layer_index: int, seed: int, n_layer: int, std: float, skip: frozenset[int] = frozenset()
) -> None:
    """Initialise every parameter of one layer in place (see module docstring), except those whose
    id() is in `skip` (a tied matrix already drawn by the layer that owns it)."""
    for name, param in layer.named_parameters():
        if id(param) not in skip:
            init_parameter_(param, layer_index, name, seed, n_layer, std, layernorm=_is_layernorm(layer, name))


def init_parameter_(
    param: nn.Parameter, layer_index: int, name: str, seed: int, n_layer: int, std: float, layernorm: bool = False
) -> None:
    """Draw one parameter as the full tensor `name` of layer `layer_index` and keep this rank's piece."""
    full_shape, device = tuple(getattr(param, "full_shape", param.shape)), param.device
    if layernorm:
        full = (torch.ones if name.endswith("weight") else torch.zeros)(full_shape, device=device)
    elif name.endswith("bias"):
        full = torch.zeros(full_shape, device=device)
    else:
        scale = std / (2 * n_layer) ** 0.5 if name.endswith(RESIDUAL_PROJECTIONS) else std
        gen = torch.Generator(device=device).manual_seed(parameter_seed(seed, layer_index, name))
        full = torch.randn(full_shape, generator=gen, device=device) * scale
    shard_of = getattr(param, "shard_of", None)
    local = shard_of(full) if shard_of is not None else full
    with torch.no_grad():
        param.copy_(local.to(dtype=param.dtype))


def _is_layernorm(layer: nn.Module, param_name: str) -> bool:
    owner = layer.get_submodule(param_name.rpartition(".")[0]) if "." in param_name else layer
    return isinstance(owner, nn.LayerNorm)


def materialize_(module: nn.Module, device: torch.device | str) -> None:
    """Allocate storage for a meta-built module on `device`, keeping parameter attributes.

    `to_empty` makes new Parameter objects, which would drop the sharding hints (`full_shape`,
    `shard_of`) and DeepSpeed's `model_parallel`; they are carried over by parameter name. Ties
    between parameters are not kept: re-tie afterwards.
    """
    attributes = {name: dict(p.__dict__) for name, p in module.named_parameters(remove_duplicate=False)}
    module.to_empty(device=device)
    for name, param in module.named_parameters(remove_duplicate=False):
        param.__dict__.update(attributes[name])
