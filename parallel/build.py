"""One build path for every layout: this rank's part of the model.

    model.gpt.layer_list(config)   [Embedding, Block_0 … Block_{L-1}, Head], on the meta device
      → this stage's layers        all of them when pp = 1 (parallel/pipeline.py: stage_bounds)
      → tensor-parallel plan       parallel/tensor.py: shard_layer, the same for every layer,
                                   and set_overlap (parallel.overlap_communication)
      → allocate, initialise       by index in the full list (model.gpt.init_layers_), so the full
                                   weights are the one-process model's whatever the layout;
                                   skipped for device="meta" (shapes only, see build_model)
      → a GPT (pp = 1)             the layers in model/'s own container, embedding tied to the head
        or PipelineStages (pp > 1) a DeepSpeed PipelineModule holding this stage's layers

The loss is tensor.loss_for(head) in both cases. `local_layers(part)` gives back {index in the
full list: layer} for either kind of part, which is all generation and naming need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model import GPT, GPTConfig
from model.gpt import init_layers_, layer_list
from model.init import materialize_
from parallel.pipeline import PipelineStages, stage_bounds
from parallel.tensor import TP_PLAN, check_plan, full_plan, loss_for, set_overlap, shard_layer
from parallel.topology import check_layout


@dataclass(frozen=True)
class BuildOptions:
    """How this rank's part is built, beyond the topology's (tp, pp, dp)."""

    sequence_parallel: bool = False  # with tp > 1: activations between blocks split along the sequence
    activation_checkpointing: int | str = 0  # k > 0: recompute each run of k blocks in backward; "selective"
    overlap_communication: bool = True  # with tp > 1: input-gradient all-reduces overlap the weight-gradient GEMMs


def build_model(
    config: GPTConfig, topology, seed: int, device: torch.device | str, options: BuildOptions = BuildOptions()
) -> nn.Module:
    """This rank's part of the model for topology's layout, initialised (see module docstring).

    device="meta" gives the part's exact structure (parameter names, local shapes, sharding and
    tying) and nothing else: no storage is allocated and nothing is initialised, so even a 175B
    stage is built in well under a second (the planner's dry run builds every rank's part so).
    """
    check_layout(config.n_head, config.d_ff, topology.tp_size, topology.pp_size, config.n_layer, topology.world_size)
    with torch.device("meta"):
        layers = layer_list(config)
    check_plan(full_plan(TP_PLAN, options.sequence_parallel), _module_names(layers))
    bounds = stage_bounds(config.n_layer, topology.pp_size)
    local = {i: layers[i] for i in range(bounds[topology.pp_rank], bounds[topology.pp_rank + 1])}
    for index, layer in local.items():
        shard_layer(layer, topology, TP_PLAN, options.sequence_parallel, index)
        set_overlap(layer, options.overlap_communication)
    head = local.get(len(layers) - 1)
    shapes_only = torch.device(device).type == "meta"
    if topology.pp_size == 1:
        model = GPT(config, layers)  # ties the unembedding to the embedding
        model.loss_fn = loss_for(head)
        model.activation_checkpointing = options.activation_checkpointing
        return model if shapes_only else model.materialize(device, seed)
    if not shapes_only:
        for layer in local.values():
            materialize_(layer, device)
        init_layers_(local, config, seed)
    return PipelineStages(layers, topology, loss_for(head), options.activation_checkpointing)


def local_layers(part: nn.Module) -> dict[int, nn.Module]:
    """{index in the full layer list: layer} of this rank's part (a GPT or PipelineStages), in order."""
    if isinstance(part, PipelineStages):
        return part.local_layers()
    return dict(enumerate(part.layers))


def _module_names(layers: list[nn.Module]) -> list[str]:
    return [name for i, layer in enumerate(layers) for name, _ in layer.named_modules(prefix=f"layers.{i}")]
