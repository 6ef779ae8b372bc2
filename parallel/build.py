"""One build path for every layout: this rank's part of the model.

    model.gpt.layer_list(config)   [Embedding, Block_0 … Block_{L-1}, Head], on the meta device, built
                                   in their modes (the Head's loss, the blocks' recomputation and
                                   which of their linears compute in float8); at pp > 1 only this
                                   rank's are built (parallel/pipeline.py: stage_layer_list)
      → this rank's layers         all of them when pp = 1; else those of its chunks (parallel/pipeline.py:
                                   StageSplit, one chunk a rank unless the schedule interleaves)
      → tensor-parallel plan       parallel/tensor.py: shard_layer, the same for every layer, each
                                   replacement built in its modes (sequence parallelism, overlap)
      → allocate, initialise       by index in the full list (model.gpt.init_layers_), so the full
                                   weights are the one-process model's whatever the layout;
                                   skipped for device="meta" (shapes only, see build_model)
      → compile the blocks         with model.compile (model/compile.py), after the weights exist
      → a GPT (pp = 1)             the layers in model/'s own container, embedding tied to the head
        or PipelineStages (pp > 1) a DeepSpeed PipelineModule holding this stage's layers

Every mode is given when a layer is built and never changed afterwards (model/modes.py). The loss is
the Head's (with options.fused_loss it unembeds chunk by chunk, model/fused_loss.py) and runs
inside the part's forward in both cases: the last stage's input carries the targets
(parallel/pipeline.py). `local_layers(part)` gives back {index in the full list: layer} for either
kind of part, which is all naming needs; `decoding_layers` the same layers as decoding runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model import GPT, GPTConfig
from model.compile import compile_blocks
from model.gpt import init_layers_, layer_list, make_layer
from model.init import materialize_
from model.modes import BLOCK_LINEARS, Float8, LayerModes
from model.weight_grads import WeightGradStore
from parallel.pipeline import PipelineStages, StageSplit, stage_layer_list
from parallel.schedules.placement import Placement
from parallel.tensor import TP_PLAN, SequenceParallelLayerNorm, check_plan, full_plan, shard_layer
from parallel.topology import check_layout


@dataclass(frozen=True)
class BuildOptions:
    """How this rank's part is built, beyond the topology's (tp, pp, dp)."""

    sequence_parallel: bool = False  # with tp > 1: activations between blocks split along the sequence
    activation_checkpointing: int | str = 0  # k > 0: recompute each run of k blocks in backward; "selective"
    overlap_communication: bool = True  # with tp > 1: input-gradient all-reduces overlap the weight-gradient GEMMs
    # with sequence parallelism: the linears' all-gathers and reduce-scatters in ring steps behind their GEMM chunks
    tp_comm_overlap: bool = False
    fused_loss: bool = False  # the Head's loss unembeds its hidden states chunk by chunk (train.fused_loss)
    fp8: Float8 | None = None  # the blocks' linears compute in float8 (train.precision=fp8; model/float8.py)
    # which of each block's linears (model.modes.BLOCK_LINEARS) `fp8` applies to; the others compute in the
    # compute dtype (train.precision=fp8: the run specification's choice, train/planner/fp8_rule.py)
    fp8_linears: frozenset = frozenset(BLOCK_LINEARS)
    # the blocks' linears defer their weight gradients to this store (parallel.pipeline_schedule=zb-h1;
    # model/weight_grads.py), drained by the pipeline engine (parallel/zero_bubble_engine.py)
    weight_grads: WeightGradStore | None = None
    # with pp > 1: the layers of each virtual stage and where it runs (parallel.pipeline_schedule, virtual_stages,
    # stage_layers); None: one chunk a rank, blocks balanced by count
    stages: StageSplit | None = None

    @property
    def layer_modes(self) -> LayerModes:
        """The modes of the model's own layers (the rest are the tensor-parallel layers'; a tensor-parallel
        linear keeps the float8 recipe of the layer it replaces)."""
        return LayerModes(fused_loss=self.fused_loss, activation_checkpointing=self.activation_checkpointing,
                          fp8=self.fp8, weight_grads=self.weight_grads, fp8_linears=self.fp8_linears)


def build_model(
    config: GPTConfig, topology, seed: int, device: torch.device | str, options: BuildOptions = BuildOptions()
) -> nn.Module:
    """This rank's part of the model for topology's layout, initialised (see module docstring).

    device="meta" gives the part's exact structure (parameter names, local shapes, sharding and
    tying) and nothing else: no storage is allocated and nothing is initialised, so even a 175B
    stage is built in well under a second (the planner's dry run builds every rank's part so).
    """
    check_layout(config.n_head, config.d_ff, topology.tp_size, topology.pp_size, config.n_layer, topology.world_size)
    modes = options.layer_modes
    split = options.stages or StageSplit(Placement(topology.pp_size))
    if split.placement.stages > config.n_layer:
        raise ValueError(f"{split.placement.stages} virtual pipeline stages for {config.n_layer} blocks: each needs one")
    with torch.device("meta"):
        if topology.pp_size == 1:
            layers = layer_list(config, modes)
        else:
            layers = stage_layer_list(config, modes, topology.pp_rank, split)
        kinds = [make_layer(config, i, modes) for i in (0, 1, config.n_layer + 1)]  # one layer of each class
    check_plan(full_plan(TP_PLAN, options.sequence_parallel), _module_names(kinds))
    local = {i: layers[i] for i in split.layers_of(config.n_layer, topology.pp_rank)}
    for index, layer in local.items():
        shard_layer(layer, topology, TP_PLAN, options.sequence_parallel, index, options.overlap_communication,
                    options.tp_comm_overlap)
    shapes_only = torch.device(device).type == "meta"
    if topology.pp_size == 1:
        model = GPT(config, layers, modes)  # ties the unembedding to the embedding
        if shapes_only:
            return model
        model.materialize(device, seed)
    else:
        if not shapes_only:
            for layer in local.values():
                materialize_(layer, device)
            init_layers_(local, config, seed)
        model = PipelineStages(layers, topology, modes.checkpoint_every, split)
    if config.compile and not shapes_only and compile_blocks(local.values(), device) and options.weight_grads is not None:
        options.weight_grads.compile()  # the deferred weight-gradient pass as a compiled piece of its own
    return model


def local_layers(part: nn.Module) -> dict[int, nn.Module]:
    """{index in the full layer list: layer} of this rank's part (a GPT or PipelineStages), in order."""
    if isinstance(part, PipelineStages):
        return part.local_layers()
    return dict(enumerate(part.layers))


def decoding_layers(part: nn.Module, config: GPTConfig, topology) -> dict[int, nn.Module]:
    """This rank's layers of `part` as decoding runs them: its own, or for a part built with sequence
    parallelism (a step of one token cannot be split over ranks) twins built without it, by the same
    plan, that share the part's parameters, so the same weights compute as plain tensor parallelism."""
    local = local_layers(part)
    if not any(isinstance(module, SequenceParallelLayerNorm) for module in part.modules()):
        return local
    with torch.device("meta"):
        layers = layer_list(config)
    twins = {}
    for index, layer in local.items():
        twins[index] = shard_layer(layers[index], topology, TP_PLAN, sequence_parallel=False, index=index, overlap=False)
        for name, parameter in layer.named_parameters(remove_duplicate=False):
            owner, _, attr = name.rpartition(".")
            setattr(twins[index].get_submodule(owner), attr, parameter)
    return twins


def _module_names(layers: list[nn.Module]) -> list[str]:
    return [name for i, layer in enumerate(layers) for name, _ in layer.named_modules(prefix=f"layers.{i}")]
