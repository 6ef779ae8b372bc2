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
from functools import lru_cache

import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.utils import partition_balanced
from torch import nn

from model import GPTConfig
from model.gpt import TIED_COPY, TIED_OWNER, layer_type, make_layer, run_layers
from model.modes import LayerModes


@lru_cache(maxsize=256)
def stage_bounds(n_layer: int, pp: int) -> tuple[int, ...]:
    """Stage s holds layers [b[s], b[s+1]) of [Embedding, Block × n_layer, Head]; returns b (pp + 1 entries).
    Cached: DeepSpeed's search takes a tenth of a second for 96 blocks over 16 stages."""
    is_block = [0] + [1] * n_layer + [0]
    return tuple(int(b) for b in partition_balanced(weights=is_block, num_parts=pp))


class OtherStageLayer(LayerSpec):
    """A layer of another stage, in this stage's list: its class, which DeepSpeed's partition by type
    name reads, and nothing built."""

    def __init__(self, kind: type[nn.Module], index: int):
        super().__init__(kind)
        self.index = index

    def build(self, log=False):
        raise RuntimeError(f"DeepSpeed put layer {self.index} on this stage, against stage_bounds")


def stage_layer_list(config: GPTConfig, modes: LayerModes, stage: int, pp: int) -> list[nn.Module | LayerSpec]:
    """The flat layer list as stage `stage` of `pp` gives it to DeepSpeed: its own layers built (on the
    current device, in `modes`), every other one an `OtherStageLayer`. (All L + 2 built, even on the
    meta device, would cost every rank of a 175B run about a second.)"""
    bounds = stage_bounds(config.n_layer, pp)
    own = range(bounds[stage], bounds[stage + 1])
    return [make_layer(config, i, modes) if i in own else OtherStageLayer(layer_type(config, i), i)
            for i in range(config.n_layer + 2)]


class PipelineStages(PipelineModule):
    """This rank's stage of the layer list as a DeepSpeed PipelineModule.

    layers: the full list, with this stage's layers built (sharded, allocated, initialised, in their
    modes) and the others left on the meta device or as `OtherStageLayer`s, never touched. checkpoint_every = k > 0
    recomputes each run of k blocks in backward, as a whole GPT does (model.gpt.run_layers).

    A stage whose own layers are on the meta device too is a shapes-only stage (parallel.build with
    device="meta"): it stays on meta (`shapes_only`), where DeepSpeed would move it to the accelerator.
    """

    def __init__(self, layers: list[nn.Module], topology, checkpoint_every: int = 0):
        bounds = stage_bounds(len(layers) - 2, topology.pp_size)
        expected = list(bounds[topology.pp_rank : topology.pp_rank + 2])
        on_meta = {p.is_meta for layer in layers[expected[0] : expected[1]] for p in layer.parameters()}
        if len(on_meta) > 1:
            raise ValueError("this stage's layers are partly on the meta device: build all of them, or none")
        self.shapes_only = on_meta == {True}  # a plain attribute, so it may be set before Module.__init__
        with contextlib.redirect_stdout(io.StringIO()):  # rank 0 prints the seeds
            super().__init__(layers=layers, topology=topology.grid_topology, partition_method="type:Block")
        self.checkpoint_every = checkpoint_every
        self.tied_comms = self._tie_embedding(len(layers) - 1)

    def _partition_layers(self, method: str = "type:Block") -> None:
        """DeepSpeed's partition by type name, as `stage_bounds` computes it (cached: DeepSpeed would search
        again for every part it builds, a tenth of a second at 175B, 128 times over in the planner's dry run)."""
        self.parts = list(stage_bounds(self._num_layers - 2, self.num_stages))
        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]):
        """(token ids (B, T) on stage 0, else hidden states (B, T, d); targets (B, T)) → the same pair
        for the next stage, or on the last stage the loss (the Head's, model.layers.Head)."""
        x, targets = inputs
        every = self.checkpoint_every if self.training else 0
        out = run_layers(self.forward_funcs, x, targets, checkpoint_every=every)
        return out if self.stage_id == self.num_stages - 1 else (out, targets)

    def to(self, *args, **kwargs):
        """nn.Module.to, except that a shapes-only stage stays on meta: it has no data to move, and
        PipelineModule.__init__ moves every stage to the accelerator."""
        return self if self.shapes_only else super().to(*args, **kwargs)

    def local_layers(self) -> dict[int, nn.Module]:
        """{index in the full layer list: layer} for this stage's layers, in order."""
        return {self._local_start + i: layer for i, layer in enumerate(self.forward_funcs)}

    def _tie_embedding(self, head_index: int) -> dict:
        """The token embedding (stage 0) and the unembedding (last stage) as one tied weight, in the
        form DeepSpeed's PipelineEngine reads ({key: {ranks, group, weight_attr, module}})."""
        grid, last = self._grid, self.num_stages - 1
        owner_layer, owner_name = TIED_OWNER
        local = self.local_layers()
        comms = {}
        for dp in range(grid.data_parallel_size):  # every rank creates every group, in one order
            for tp in range(grid.get_slice_parallel_world_size()):
                ranks = [grid.stage_to_global(stage_id=s, data=dp, model=tp) for s in (0, last)]
                group = dist.new_group(ranks=ranks)
                if self.global_rank not in ranks:
                    continue
                layer, attr = (local[owner_layer], owner_name) if self.stage_id == 0 else (local[head_index], TIED_COPY)
                comms["embedding"] = {"ranks": ranks, "group": group, "weight_attr": [attr], "module": layer}
                if self.stage_id == last:
                    layer.get_parameter(attr).ds_pipe_replicated = True  # counted once, on stage 0
        return comms

    def get_tied_weights_and_groups(self):
        return [(c["module"].get_parameter(c["weight_attr"][0]), c["group"]) for c in self.tied_comms.values()]

    def allreduce_tied_weight_gradients(self):
        for weight, group in self.get_tied_weights_and_groups():
            dist.all_reduce(weight.grad, group=group)
