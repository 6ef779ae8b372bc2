"""How layers go to pipeline stages: the model's own flat layer list, cut into DeepSpeed stages.

    stage 0                          stages …            last stage
    Embedding → Block … │ Block … │ … │ Block … → Head (final LayerNorm, unembedding, loss)
        wte ─────────────── the tied matrix: gradients summed ──────────────── lm_head
    (ids, targets) ─► (hidden, targets) ─► … ─► loss

The layers are model/'s own (model.gpt.layer_list): blocks are balanced over pp stages by count
(`stage_bounds`, DeepSpeed's partition_balanced, as its "type:Block" method, which
PipelineStages takes from it), the Embedding
joins the first stage and the Head the last. parallel/build.py builds only this stage's layers.

The loss runs inside the last stage's forward, as the Head's own (model.layers.Head): a micro
batch enters stage 0 as (token ids, targets), and every stage passes (hidden states, targets) on,
the targets (B, T) riding along with the activations (8·B·T bytes beside 2·B·T·d). DeepSpeed's
engine therefore gets the loss as the module's output and computes nothing itself (loss_fn is
None): its backward hooks on that output run before any gradient exists. A loss computed
outside the module would use the tied matrix outside them, and DeepSpeed's bf16 optimizer would
then clear the unembedding's gradient after the loss's backward had already written it.

The token embedding is also the unembedding. On one process both are one Parameter; across
stages the first stage's `wte.weight` and the last stage's `lm_head.weight` are two copies,
drawn equal at init (model.gpt.init_layers_), whose gradients are summed over the pair of ranks
(same data- and tensor-parallel coordinates) after every backward, so both take the same step.
DeepSpeed's PipelineEngine does that sum through the module's `tied_comms`; the last stage's copy is
marked `ds_pipe_replicated`, so gradient norms count the matrix once.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.utils import partition_balanced
from torch import nn

from model import GPTConfig
from model.gpt import TIED_COPY, TIED_OWNER, layer_type, make_layer, run_layers
from model.modes import LayerModes
from parallel.schedules.placement import Placement


@lru_cache(maxsize=256)
def stage_bounds(n_layer: int, stages: int, blocks: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Virtual stage v holds layers [b[v], b[v+1]) of [Embedding, Block × n_layer, Head]; returns b (stages + 1
    entries). `blocks`: the blocks of each stage (parallel.stage_layers), else balanced by count (DeepSpeed's
    partition_balanced). Cached: DeepSpeed's search takes a tenth of a second for 96 blocks over 16 stages."""
    if blocks is None:
        is_block = [0] + [1] * n_layer + [0]
        return tuple(int(b) for b in partition_balanced(weights=is_block, num_parts=stages))
    if len(blocks) != stages or sum(blocks) != n_layer or min(blocks) < 1:
        raise ValueError(f"parallel.stage_layers={list(blocks)}: give {stages} counts of blocks, each ≥ 1, summing to "
                         f"model.n_layer={n_layer}")
    ends = [1 + sum(blocks[: v + 1]) for v in range(stages)]
    return (0, *ends[:-1], n_layer + 2)


@dataclass(frozen=True)
class StageSplit:
    """The model's layers cut into virtual stages and where those run: `placement`, and `blocks` per virtual
    stage (None: balanced)."""

    placement: Placement
    blocks: tuple[int, ...] | None = None

    def bounds(self, n_layer: int) -> tuple[int, ...]:
        return stage_bounds(n_layer, self.placement.stages, self.blocks)

    def chunks(self, n_layer: int, rank: int) -> list[range]:
        """The layer indices of each chunk of pipeline rank `rank`, chunk 0 first."""
        b = self.bounds(n_layer)
        return [range(b[v], b[v + 1]) for v in self.placement.stages_of(rank)]

    def layers_of(self, n_layer: int, rank: int) -> list[int]:
        """Every layer index pipeline rank `rank` holds, in increasing order."""
        return [i for chunk in self.chunks(n_layer, rank) for i in chunk]


class OtherStageLayer(LayerSpec):
    """A layer of another stage, in this stage's list: its class, which DeepSpeed's partition by type
    name reads, and nothing built."""

    def __init__(self, kind: type[nn.Module], index: int):
        super().__init__(kind)
        self.index = index

    def build(self, log=False):
        raise RuntimeError(f"layer {self.index} belongs to another pipeline rank")


def stage_layer_list(config: GPTConfig, modes: LayerModes, rank: int, split: StageSplit) -> list[nn.Module | LayerSpec]:
    """The flat layer list as pipeline rank `rank` gives it to DeepSpeed: its own layers built (on the current
    device, in `modes`), every other one an `OtherStageLayer`. (All L + 2 built, even on the meta device,
    would cost every rank of a 175B run about a second.)"""
    own = set(split.layers_of(config.n_layer, rank))
    return [make_layer(config, i, modes) if i in own else OtherStageLayer(layer_type(config, i), i)
            for i in range(config.n_layer + 2)]


class PipelineStages(PipelineModule):
    """This rank's chunks of the layer list as a DeepSpeed PipelineModule.

    layers: the full list, with this rank's layers built (sharded, allocated, initialised, in their
    modes) and the others left on the meta device or as `OtherStageLayer`s, never touched. `split`: the
    layers of each virtual stage and the rank each runs on (one chunk a rank for 1f1b and zb-h1); a
    forward runs chunk `chunk` (the pipeline engine sets it, parallel/schedules/engine.py). checkpoint_every
    = k > 0 recomputes each run of k blocks in backward, as a whole GPT does (model.gpt.run_layers).

    A rank whose own layers are on the meta device too is a shapes-only part (parallel.build with
    device="meta"): it stays on meta (`shapes_only`), where DeepSpeed would move it to the accelerator.
    """

    def __init__(self, layers: list[nn.Module], topology, checkpoint_every: int = 0, split: StageSplit | None = None):
        # plain attributes, so they may be set before Module.__init__ (which partitions and builds)
        self.split = split or StageSplit(Placement(topology.pp_size))
        self.placement = self.split.placement
        if self.placement.pp != topology.pp_size:
            raise ValueError(f"the stages are placed on {self.placement.pp} ranks, the layout has pp={topology.pp_size}")
        own = self.split.layers_of(len(layers) - 2, topology.pp_rank)
        on_meta = {p.is_meta for i in own for p in layers[i].parameters()}
        if len(on_meta) > 1:
            raise ValueError("this rank's layers are partly on the meta device: build all of them, or none")
        self.shapes_only = on_meta == {True}
        with contextlib.redirect_stdout(io.StringIO()):  # rank 0 prints the seeds
            super().__init__(layers=layers, topology=topology.grid_topology, partition_method="type:Block")
        self.checkpoint_every = checkpoint_every
        self.chunk = 0
        self.tied_comms = self._tie_embedding(len(layers) - 1)

    def _partition_layers(self, method: str = "type:Block") -> None:
        """DeepSpeed's bounds, from `split` (DeepSpeed's own partition would search again for every part it
        builds, a tenth of a second at 175B, 128 times over in the planner's dry run). With several chunks a
        rank the bounds span them all; `_build` builds only this rank's."""
        self.parts = list(self.split.bounds(self._num_layers - 2))  # per virtual stage
        own = self.split.layers_of(self._num_layers - 2, self.stage_id)
        self._set_bounds(start=own[0], stop=own[-1] + 1)

    def _build(self) -> None:
        """This rank's layers registered by their index in the full list (as DeepSpeed names them)."""
        self._chunks, self._ends_in_head = [], []  # each chunk's layers; whether its last is the Head
        for chunk in self.split.chunks(self._num_layers - 2, self.stage_id):
            self._chunks.append([self._layer_specs[i] for i in chunk])
            self._ends_in_head.append(chunk[-1] == self._num_layers - 1)
            for i in chunk:
                self.forward_funcs.append(self._layer_specs[i])
                self.add_module(str(i), self._layer_specs[i])
        for p in self.parameters():
            p.ds_pipe_replicated = False

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]):
        """(token ids (B, T) on virtual stage 0, else hidden states (B, T, d); targets (B, T)) → the same pair
        for the next stage, or on the last virtual stage the loss (the Head's, model.layers.Head); through
        the layers of chunk `chunk`."""
        x, targets = inputs
        every = self.checkpoint_every if self.training else 0
        layers = self._chunks[self.chunk]
        out = run_layers(layers, x, targets, checkpoint_every=every)
        return out if self._ends_in_head[self.chunk] else (out, targets)

    def to(self, *args, **kwargs):
        """nn.Module.to, except that a shapes-only stage stays on meta: it has no data to move, and
        PipelineModule.__init__ moves every stage to the accelerator."""
        return self if self.shapes_only else super().to(*args, **kwargs)

    def local_layers(self) -> dict[int, nn.Module]:
        """{index in the full layer list: layer} for this rank's layers, in order."""
        return dict(zip(self.split.layers_of(self._num_layers - 2, self.stage_id), self.forward_funcs, strict=True))

    def _tie_embedding(self, head_index: int) -> dict:
        """The token embedding (virtual stage 0) and the unembedding (the last) as one tied weight: on two
        ranks, in the form DeepSpeed's PipelineEngine reads ({key: {ranks, group, weight_attr, module}}); on
        one (zb-v's V), one Parameter, as in the whole model."""
        grid = self._grid
        first, last = self.placement.rank_of(0), self.placement.rank_of(self.placement.stages - 1)
        owner_layer, owner_name = TIED_OWNER
        local = self.local_layers()
        comms = {}
        if first == last:
            if self.stage_id == first:
                owner = local[owner_layer].get_parameter(owner_name)
                holder, _, attr = TIED_COPY.rpartition(".")
                setattr(local[head_index].get_submodule(holder), attr, owner)
            return comms
        for dp in range(grid.data_parallel_size):  # every rank creates every group, in one order
            for tp in range(grid.get_slice_parallel_world_size()):
                ranks = [grid.stage_to_global(stage_id=s, data=dp, model=tp) for s in (first, last)]
                group = dist.new_group(ranks=ranks)
                if self.global_rank not in ranks:
                    continue
                layer, attr = (local[owner_layer], owner_name) if self.stage_id == first else (local[head_index], TIED_COPY)
                comms["embedding"] = {"ranks": ranks, "group": group, "weight_attr": [attr], "module": layer}
                if self.stage_id == last:
                    layer.get_parameter(attr).ds_pipe_replicated = True  # counted once, on the embedding's rank
        return comms

    def get_tied_weights_and_groups(self):
        return [(c["module"].get_parameter(c["weight_attr"][0]), c["group"]) for c in self.tied_comms.values()]

    def allreduce_tied_weight_gradients(self):
        for weight, group in self.get_tied_weights_and_groups():
            dist.all_reduce(weight.grad, group=group)
