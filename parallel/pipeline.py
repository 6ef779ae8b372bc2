"""How layers go to pipeline stages: the model's own flat layer list, cut into DeepSpeed stages.

    stage 0                          stages …            last stage
    Embedding → Block … │ Block … │ … │ Block … → Head (final LayerNorm, unembedding) → loss
        wte ─────────────── the tied matrix: gradients summed ──────────────── lm_head

The layers are model/'s own (model.gpt.layer_list): blocks are balanced over pp stages by count
(`stage_bounds`, DeepSpeed's partition_balanced, as its "type:Block" method), the Embedding
joins the first stage and the Head the last. parallel/build.py builds only this stage's layers.

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

import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.utils import partition_balanced
from torch import nn

from model.gpt import SELECTIVE, TIED_COPY, TIED_OWNER, set_selective_recomputation


@lru_cache(maxsize=256)
def stage_bounds(n_layer: int, pp: int) -> tuple[int, ...]:
    """Stage s holds layers [b[s], b[s+1]) of [Embedding, Block × n_layer, Head]; returns b (pp + 1 entries).
    Cached: DeepSpeed's search takes a tenth of a second for 96 blocks over 16 stages."""
    is_block = [0] + [1] * n_layer + [0]
    return tuple(int(b) for b in partition_balanced(weights=is_block, num_parts=pp))


class PipelineStages(PipelineModule):
    """This rank's stage of the layer list as a DeepSpeed PipelineModule.

    layers: the full list, with this stage's layers built (sharded, allocated, initialised) and the
    others left on the meta device, never touched. loss_fn applies on the last stage;
    activation_checkpointing=k recomputes runs of k layers in backward (blocks only), "selective"
    makes this stage's blocks recompute their LayerNorm and GELU outputs (model.layers.Block).

    A stage whose own layers are on the meta device too is a shapes-only stage (parallel.build with
    device="meta"): it stays on meta (`shapes_only`), where DeepSpeed would move it to the accelerator.
    """

    def __init__(self, layers: list[nn.Module], topology, loss_fn, activation_checkpointing: int | str = 0):
        bounds = stage_bounds(len(layers) - 2, topology.pp_size)
        expected = list(bounds[topology.pp_rank : topology.pp_rank + 2])
        selective = activation_checkpointing == SELECTIVE
        set_selective_recomputation(layers[expected[0] : expected[1]], selective)
        on_meta = {p.is_meta for layer in layers[expected[0] : expected[1]] for p in layer.parameters()}
        if len(on_meta) > 1:
            raise ValueError("this stage's layers are partly on the meta device: build all of them, or none")
        self.shapes_only = on_meta == {True}  # a plain attribute, so it may be set before Module.__init__
        with contextlib.redirect_stdout(io.StringIO()):  # rank 0 prints the partition and seeds
            super().__init__(
                layers=layers,
                topology=topology.grid_topology,
                loss_fn=loss_fn,
                partition_method="type:Block",
                activation_checkpoint_interval=0 if selective else activation_checkpointing,
                checkpointable_layers=["Block"],
            )
        if [self._local_start, self._local_stop] != expected:
            placed = [self._local_start, self._local_stop]
            raise RuntimeError(f"DeepSpeed put layers {placed} on this stage, expected {expected}")
        self.tied_comms = self._tie_embedding(len(layers) - 1)

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
