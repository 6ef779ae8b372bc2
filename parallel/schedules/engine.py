"""DeepSpeed's PipelineEngine running gpt3d's own pipeline schedules (zb-h1, interleaved, zb-v; 1f1b stays
DeepSpeed's): each step, training or evaluation, runs the rank's program (parallel/schedules/program.py).

Why on DeepSpeed's engine, not torch.distributed.pipelining's schedules: gpt3d's pipeline is DeepSpeed's
(its ZeRO-1 optimizer, bf16 masters, tied-embedding reduction and checkpoints all go through the engine),
and torch's zero-bubble schedules split B from W by rewriting the autograd graph and running its
weight-gradient nodes again, which would rerun the input-gradient product and the tensor-parallel
collective that gpt3d's fused linears do in one backward (model/recompute.py). Here the linears
themselves defer W (model/weight_grads.py), and the engine adds only the instructions around DeepSpeed's
own forward, backward, loading, gradient reductions and optimizer step.

Virtual stages. A rank holding several chunks (parallel/schedules/placement.py) runs DeepSpeed's forward
and backward once per chunk: the module runs the chunk the pass names (PipelineStages.chunk), and while
a pass runs `is_first_stage` and `is_last_stage` answer for its virtual stage, so DeepSpeed's code loads
the micro batch on virtual stage 0, keeps the loss on the last and partitions what goes between.

What the engine adds:
  Forward                  waits for the posted receive of its input, then DeepSpeed's forward; on the
                           last stage it keeps each micro batch's loss for that micro batch's B
  InputGradPass (B)        DeepSpeed's backward of the micro batch, its gradient taken from the posted
                           receive; where the schedule splits W off, the block linears defer their weight
                           gradients, sealed as one W. Under DeepSpeed's bf16 optimizer the backward has
                           added the bf16 gradients to the fp32 ones; B then drops them (None), so the
                           next backward writes them fresh instead of zeroing and accumulating them
                           (DeepSpeed's own 1F1B keeps them: 10 bytes a parameter and micro batch more)
  WeightGradPass (W)       the oldest W; under DeepSpeed's bf16 optimizer its parameters' bf16 gradients
                           are added to their fp32 gradients at once and dropped (set to None), so B's
                           clearing and update, which skip gradients that are None, pass over them:
                           each parameter's gradient goes through the optimizer's update once per micro
                           batch, as under 1F1B, in B or in W
  SendActivation/SendGrad  isend (DeepSpeed's are blocking), waited on at the start of the rank's next pass
  HandOff*                 the same message between two stages of this rank, in memory
  PostRecv*                irecv into fresh buffers, waited on by the pass that uses them
  WaitSends                every send done, every W run, before ReduceTiedGrads, ReduceGrads, OptimizerStep
  ReduceGrads              with `reduce_chunks` (interleaved, DeepSpeed's bf16 optimizer, dp > 1) each chunk's
                           data-parallel reduction was issued at the start of the pass after its last B
                           (parallel/schedules/grad_reduction.py): it waits for those and reduces the rest as
                           DeepSpeed does; else DeepSpeed's, all at once

The shapes of what goes between stages (every stage's output has the same: hidden states and targets,
or their tensor-parallel partition) are broadcast over the pipeline group once per step by the rank of
virtual stage 0 after its first forward; the others take them before their first pass, and that rank
holds its own receives back until then. No other rank can start a pass before that forward ends anyway.

deepspeed.initialize chooses the engine's class from the module's type, with no way to name a subclass;
`ScheduleEngine.adopt` turns the PipelineEngine it made into this class, which adds methods and no
construction of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds
from deepspeed.runtime.pipe.engine import MEMORY_OPT_ALLREDUCE_SIZE, PipelineEngine
from deepspeed.runtime.utils import PartitionedTensor

from model.weight_grads import WeightGradStore
from parallel.schedules.grad_reduction import ChunkReductions, reduces_chunks
from parallel.schedules.orders import SPLIT_BACKWARD, Costs, placement_of
from parallel.schedules.program import (
    Forward,
    HandOffActivation,
    HandOffGrad,
    InputGradPass,
    PipelineProgram,
    PostRecvActivation,
    PostRecvGrad,
    SendActivationAsync,
    SendGradAsync,
    WaitSends,
    WeightGradPass,
)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32)
_TEMPLATE_SIZE = 32  # [count, (dtype index, ndim, 4 sizes) per tensor], at most 5 tensors


class ScheduleEngine(PipelineEngine):
    """A PipelineEngine whose train_batch and eval_batch run `schedule`'s program (see the module docstring)."""

    @classmethod
    def adopt(cls, engine: PipelineEngine, schedule: str, virtual_stages: int = 1, store: WeightGradStore | None = None,
              costs: Costs = Costs(), reduce_chunks: bool = False) -> "ScheduleEngine":
        """Make `engine` (what deepspeed.initialize built for a PipelineStages whose block linears defer their
        weight gradients to `store` where `schedule` splits W off, else None) run `schedule`; returns it.
        reduce_chunks (parallel.overlap_communication): each chunk's data-parallel gradient reduction issued after
        its last B, where there is one to issue (several chunks and no split W, DeepSpeed's bf16 optimizer, other
        data-parallel ranks: `ChunkReductions`)."""
        if type(engine) is not PipelineEngine:
            raise TypeError(f"{schedule} runs on DeepSpeed's PipelineEngine, not {type(engine).__name__}")
        if (store is not None) != (schedule in SPLIT_BACKWARD):
            raise ValueError(f"{schedule}: the blocks defer their weight gradients exactly when the schedule splits W "
                             f"off ({', '.join(SPLIT_BACKWARD)})")
        if engine.is_pipe_partitioned != engine.is_grad_partitioned:
            raise ValueError(f"{schedule} needs DeepSpeed's pipeline.pipe_partitioned and pipeline.grad_partitioned "
                             "to be equal")
        if engine.has_attention_mask or engine.has_bool_tensors:
            raise ValueError(f"{schedule} sends no boolean tensors between stages")
        if engine.using_bf16_optimizer and engine.optimizer.immediate_grad_update:
            raise ValueError(f"{schedule} adds W's gradients to the fp32 ones itself: bf16.immediate_grad_update "
                             "must be off")
        placement = placement_of(schedule, engine.num_stages, virtual_stages)
        if engine.module.placement != placement:
            raise ValueError(f"the module's stages are placed as {engine.module.placement}, {schedule} runs {placement}")
        engine.__class__ = cls
        engine.schedule, engine.placement, engine.weight_grads, engine.zb_costs = schedule, placement, store, costs
        engine._own_stages = placement.stages_of(engine.stage_id)
        engine._stage = None  # the virtual stage of the pass under way
        engine._template = None  # [(shape, dtype)] of what goes between stages, this step
        engine._template_code = torch.zeros(_TEMPLATE_SIZE, dtype=torch.long, device=engine.device)  # its broadcast
        engine._held_posts = []  # receives posted before the template was known (the rank of stage 0)
        engine._recvs, engine._sends, engine._losses = {}, [], {}
        engine._input_grads_out = {}  # buffer → ∂L/∂(its chunk's input), made by B, until sent or handed off
        engine._fp32_index = {}  # bf16 parameter → (group, index) of its fp32 gradient in the bf16 optimizer
        if engine.using_bf16_optimizer:
            engine._fp32_index = {p: (i, j) for i, group in enumerate(engine.optimizer.bf16_groups)
                                  for j, p in enumerate(group)}
        engine._bf16_params = list(engine._fp32_index)
        engine.chunk_reductions = engine._chunk_reductions() if reduce_chunks else None
        return engine

    def _chunk_reductions(self) -> ChunkReductions | None:
        """ChunkReductions over this rank's chunks (the tied embedding left to ReduceGrads), or None where nothing
        would be reduced early: one chunk, W split off (a chunk's gradients are final only after its W passes),
        no bf16 optimizer, or no other data-parallel rank."""
        dp = dist.get_world_size(self.mpu.get_data_parallel_group())
        if (not reduces_chunks(self.schedule, self.placement.virtual, self.using_bf16_optimizer, dp)
                or not self.pipeline_enable_backward_allreduce or self.has_moe_layers):
            return None
        tied = {id(weight) for weight, _ in self.module.get_tied_weights_and_groups()}
        placed = {stage: [self._fp32_index[p] for layer in self.module._chunks[self.placement.chunk_of(stage)]
                          for p in layer.parameters() if id(p) not in tied and p in self._fp32_index]
                  for stage in self._own_stages}
        return ChunkReductions(self, placed)

    def _train_schedule(self):
        return PipelineProgram(self.schedule, self.placement, self.micro_batches, self.stage_id, self.zb_costs)

    def _inference_schedule(self, micro_batches):
        return PipelineProgram(self.schedule, self.placement, micro_batches, self.stage_id, training=False)

    def is_first_stage(self) -> bool:
        """In a pass: it runs virtual stage 0; else this rank holds it."""
        return self._stage == 0 if self._stage is not None else 0 in self._own_stages

    def is_last_stage(self) -> bool:
        """In a pass: it runs the last virtual stage (the loss); else this rank holds it."""
        last = self.placement.stages - 1
        return self._stage == last if self._stage is not None else last in self._own_stages

    def _loss_stage_global_rank(self) -> int:
        return self.grid.stage_to_global(self.placement.rank_of(self.placement.stages - 1))

    def _exec_schedule(self, pipe_schedule):
        if not isinstance(pipe_schedule, PipelineProgram):
            raise TypeError(f"{self.schedule} runs its own programs, not DeepSpeed's {type(pipe_schedule).__name__}")
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self._program_micro_batches = pipe_schedule.micro_batches
        self.fwd_outputs = []
        self._template = None
        if self.chunk_reductions is not None:
            self.chunk_reductions.start_step()
        if 0 not in self._own_stages:
            self._template = self._exchange_template(None)
        for step in pipe_schedule:
            for cmd in step:
                run = self._INSTRUCTIONS.get(type(cmd)) or PipelineEngine._INSTRUCTION_MAP[type(cmd)]
                run(self, **cmd.kwargs)

    def _exec_load_micro_batch(self, buffer_id: int) -> None:
        """DeepSpeed's load; on a rank holding both the first and the last virtual stage (zb-v) its one load
        serves both, the labels then moved to the last stage's buffer of the micro batch."""
        PipelineEngine._exec_load_micro_batch(self, buffer_id)
        last = self.placement.stages - 1
        if 0 in self._own_stages and last in self._own_stages and last > 0:
            labels = self.pipe_buffers["labels"]
            j = buffer_id % self._program_micro_batches
            labels[self.placement.chunk_of(last) * self._program_micro_batches + j] = labels[buffer_id]

    # ---- what goes between stages ----

    def _exchange_template(self, outputs) -> list[tuple[torch.Size, torch.dtype]]:
        """Broadcast from the rank of virtual stage 0 the shapes and dtypes of its first output (`outputs`
        there, None elsewhere) over this pipeline's ranks."""
        # one buffer for every step's broadcast: gloo's thread may hold the one it sent a while, and a fresh one
        # each step would be freed at a moment of its choosing (seen in bench.pipeline_memory's end-of-passes check)
        coded = self._template_code.zero_()
        if outputs is not None:
            tensors = outputs if isinstance(outputs, tuple) else (outputs,)
            values = [len(tensors)]
            for t in tensors:
                values += [_DTYPES.index(t.dtype), t.dim(), *t.shape, *[0] * (4 - t.dim())]
            coded[: len(values)] = torch.tensor(values, dtype=torch.long)
        source = self.grid.stage_to_global(self.placement.rank_of(0))
        dist.broadcast(coded, src=source, group=self.grid.get_pipe_parallel_group())
        values, template = coded.tolist(), []
        for k in range(values[0]):
            dtype, ndim, *sizes = values[1 + 6 * k : 7 + 6 * k]
            template.append((torch.Size(sizes[:ndim]), _DTYPES[dtype]))
        return template

    # ---- receives ----

    def _exec_post_recv_activation(self, buffer_id: int, peer: int) -> None:
        if self._template is None:  # only on the rank of stage 0, before its first forward
            self._held_posts.append((buffer_id, peer))
            return
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self._template]
        self._post_receives("act", buffer_id, buffers, peer)

    def _exec_post_recv_grad(self, buffer_id: int, peer: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if self.is_grad_partitioned:  # (partition metadata, this rank's part)
            buffers = [torch.zeros(outputs[0].size(), dtype=torch.long, device=self.device),
                       torch.empty_like(outputs[1])]
            buffers += [torch.empty_like(t) for t in outputs[2:] if t.is_floating_point()]
        else:
            buffers = [torch.empty_like(t) for t in outputs if t.is_floating_point()]
        self._post_receives("grad", buffer_id, buffers, peer)

    def _post_receives(self, what: str, buffer_id: int, buffers: list, peer: int) -> None:
        source = self.grid.stage_to_global(stage_id=peer)
        self._recvs[(what, buffer_id)] = (buffers, [dist.irecv(buffer, source) for buffer in buffers])

    def _received(self, what: str, buffer_id: int) -> list:
        buffers, works = self._recvs.pop((what, buffer_id))
        for work in works:
            work.wait()
        return buffers

    # ---- sends ----

    def _send(self, tensors, peer: int) -> None:
        destination = self.grid.stage_to_global(stage_id=peer)
        self._sends += [(dist.isend(tensor, destination), tensor) for tensor in tensors]

    def _release_sends(self) -> None:
        """Wait for the sends issued so far, so their tensors can be freed (gloo reports a send complete only
        once waited on). Each has its receive posted by now: a rank posts a link's receive right after its
        previous message on that link, which the predicted timeline puts no later than the send, and so on
        no pass that follows this one."""
        for work, _ in self._sends:
            work.wait()
        self._sends = []

    def _before_pass(self) -> None:
        """The sends issued so far released, then the chunk reductions that are due issued: after the last B's input
        gradient has gone, so that no send waits behind a reduction."""
        self._release_sends()
        if self.chunk_reductions is not None:
            self.chunk_reductions.issue_due()

    def _outputs(self, buffer_id: int) -> tuple:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        return outputs if isinstance(outputs, tuple) else (outputs,)

    def _input_grads(self, buffer_id: int) -> list:
        inputs = self.pipe_buffers["inputs"][buffer_id]
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        self.pipe_buffers["inputs"][buffer_id] = None
        if self.is_grad_partitioned:
            part = PartitionedTensor(tensor=inputs[0].grad, group=self.grid.get_slice_parallel_group())
            return [part.to_meta(), part.data()]
        return [t.grad for t in inputs if t.is_floating_point()]

    def _exec_send_activations_async(self, buffer_id: int, peer: int) -> None:
        self._send(self._outputs(buffer_id), peer)

    def _exec_send_grads_async(self, buffer_id: int, peer: int) -> None:
        self._send(self._input_grads_out.pop(buffer_id), peer)

    def _exec_hand_off_activation(self, buffer_id: int, to: int) -> None:
        self._recvs[("act", to)] = ([t.detach().clone() for t in self._outputs(buffer_id)], [])

    def _exec_hand_off_grad(self, buffer_id: int, to: int) -> None:
        self._recvs[("grad", to)] = (self._input_grads_out.pop(buffer_id), [])

    def _exec_wait_sends(self) -> None:
        self._release_sends()
        if self._recvs or self._held_posts or self._input_grads_out:
            raise RuntimeError(f"receives posted and never used: {sorted(self._recvs)}, {self._held_posts}; input "
                               f"gradients never sent: {sorted(self._input_grads_out)}")
        if self.weight_grads is not None:
            self.weight_grads.check_drained()

    # ---- passes ----

    def _exec_forward(self, buffer_id: int, stage: int) -> None:
        self._before_pass()
        if stage > 0:
            received = self._received("act", buffer_id)
            for tensor in received:
                tensor.requires_grad = tensor.is_floating_point()
            self.pipe_buffers["inputs"][buffer_id] = tuple(received) if len(received) > 1 else received[0]
        self._run_pass(stage, PipelineEngine._exec_forward_pass, buffer_id)
        if stage == self.placement.stages - 1 and torch.is_grad_enabled():
            self._losses[buffer_id] = self.loss
        if self._template is None:  # this rank's first forward, of virtual stage 0
            self._template = self._exchange_template(self.pipe_buffers["outputs"][buffer_id])
            held, self._held_posts = self._held_posts, []
            for held_buffer, peer in held:
                self._exec_post_recv_activation(held_buffer, peer)

    def _exec_input_grad_pass(self, buffer_id: int, stage: int) -> None:
        self._before_pass()
        last = stage == self.placement.stages - 1
        if last:
            self.loss = self._losses.pop(buffer_id)
        else:
            self.grad_layer = self._received("grad", buffer_id)
        self._run_pass(stage, PipelineEngine._exec_backward_pass, buffer_id)
        if last:  # the loss's graph holds the chunk's inputs (autograd's leaves) alive: let go of it (DeepSpeed keeps it)
            self.pipe_buffers["outputs"][buffer_id] = None
            self.loss = self.loss.detach()
        if stage == 0:  # its loaded ids and targets, which no gradient goes back to, released now (not at the buffer's reuse)
            self.pipe_buffers["inputs"][buffer_id] = None
        else:  # the input's gradient taken and the input let go now, not when the gradient is sent
            self._input_grads_out[buffer_id] = self._input_grads(buffer_id)
        if self.using_bf16_optimizer:  # added to the fp32 ones by the backward: the next one writes them fresh
            for param in self._bf16_params:
                param.grad = None
        if self.weight_grads is not None:
            self.weight_grads.seal()
        if self.chunk_reductions is not None:
            self.chunk_reductions.after_backward(stage, self._program_micro_batches)

    def _run_pass(self, stage: int, run, buffer_id: int) -> None:
        """DeepSpeed's forward or backward of `stage`'s chunk, answering for that virtual stage meanwhile."""
        self._stage = stage
        self.module.chunk = self.placement.chunk_of(stage)
        try:
            run(self, buffer_id)
        finally:
            self._stage = None

    def _exec_weight_grad_pass(self) -> None:
        self._before_pass()
        after_each = None
        if self.using_bf16_optimizer:
            for param in self.weight_grads.oldest_parameters():
                param.grad = None  # (already None: dropped by the previous W, or by the step's zero_grad)
            after_each = self._add_to_fp32_grads
        self._running_engine_backward = True
        try:
            self.weight_grads.run_oldest(after_each)
        finally:
            self._running_engine_backward = False

    def _add_to_fp32_grads(self, params: list) -> None:
        """BF16_Optimizer's update of these parameters' fp32 gradients from their bf16 ones, which are then
        dropped (B's clearing and update skip gradients that are None)."""
        for param in params:
            self.optimizer._update_hp_grad(param, *self._fp32_index[param], clear_lp_grads=False)
            param.grad = None

    def _exec_reduce_grads(self) -> None:
        """DeepSpeed's ReduceGrads, or with chunk reductions: wait for them, then reduce the gradients they left
        (as DeepSpeed reduces its bf16 optimizer's, the same operations)."""
        if self.chunk_reductions is None:
            return PipelineEngine._exec_reduce_grads(self)
        self._force_grad_boundary = True
        try:
            reduced = self.chunk_reductions.finish()
            rest = [g for group in self.optimizer.fp32_groups_gradients for g in group if id(g) not in reduced]
            if rest:
                self.buffered_allreduce_fallback(grads=rest, elements_per_buffer=MEMORY_OPT_ALLREDUCE_SIZE)
        finally:
            self._force_grad_boundary = False

    _INSTRUCTIONS = {
        ds.LoadMicroBatch: _exec_load_micro_batch,
        PostRecvActivation: _exec_post_recv_activation,
        PostRecvGrad: _exec_post_recv_grad,
        SendActivationAsync: _exec_send_activations_async,
        SendGradAsync: _exec_send_grads_async,
        HandOffActivation: _exec_hand_off_activation,
        HandOffGrad: _exec_hand_off_grad,
        Forward: _exec_forward,
        InputGradPass: _exec_input_grad_pass,
        WeightGradPass: _exec_weight_grad_pass,
        WaitSends: _exec_wait_sends,
        ds.ReduceGrads: _exec_reduce_grads,
    }
