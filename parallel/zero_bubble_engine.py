"""DeepSpeed's PipelineEngine running the ZB-H1 schedule (parallel/zero_bubble.py) for training steps.

Why on DeepSpeed's engine, not torch.distributed.pipelining's zero-bubble schedules: gpt3d's pipeline is
DeepSpeed's (its ZeRO-1 optimizer, bf16 masters, tied-embedding reduction, checkpoints and evaluation
all go through the engine), and torch's schedules split B from W by rewriting the autograd graph and
running its weight-gradient nodes again, which would rerun the input-gradient product and the
tensor-parallel collective that gpt3d's fused linears do in one backward (model/recompute.py). Here the
linears themselves defer W (model/weight_grads.py), and this engine only adds the instructions that
run it: a training step executes `stage_program`'s instructions with DeepSpeed's own forward, backward,
loading, gradient reductions and optimizer step; evaluation keeps DeepSpeed's schedule.

What the engine adds:
  Forward                  waits for the posted receive of its input, then DeepSpeed's forward; on the
                           last stage it keeps each micro batch's loss for that micro batch's B
  InputGradPass (B)        DeepSpeed's backward of the micro batch, its gradient taken from the posted
                           receive; the block linears defer their weight gradients, sealed as one W
  WeightGradPass (W)       the oldest W; under DeepSpeed's bf16 optimizer its parameters' bf16 gradients
                           are added to their fp32 gradients at once and dropped (set to None), so B's
                           clearing and update, which skip gradients that are None, pass over them:
                           each parameter's gradient goes through the optimizer's update once per micro
                           batch, as under 1F1B, in B or in W
  SendActivation/SendGrad  isend (DeepSpeed's are blocking), waited on at the start of the stage's next pass
  PostRecv*                irecv into fresh buffers, waited on by the pass that uses them
  WaitSends                every send done, every W run, before ReduceTiedGrads, ReduceGrads, OptimizerStep

deepspeed.initialize chooses the engine's class from the module's type, with no way to name a subclass;
`ZeroBubbleEngine.adopt` turns the PipelineEngine it made into this class, which adds methods and no
construction of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.utils import PartitionedTensor

from model.weight_grads import WeightGradStore
from parallel.zero_bubble import (
    Costs,
    Forward,
    InputGradPass,
    PostRecvActivation,
    PostRecvGrad,
    SendActivationAsync,
    SendGradAsync,
    WaitSends,
    WeightGradPass,
    ZeroBubbleH1,
)


class ZeroBubbleEngine(PipelineEngine):
    """A PipelineEngine whose train_batch runs ZB-H1 (see the module docstring)."""

    @classmethod
    def adopt(cls, engine: PipelineEngine, store: WeightGradStore, costs: Costs = Costs()) -> "ZeroBubbleEngine":
        """Make `engine` (what deepspeed.initialize built for a PipelineModule whose block linears defer
        their weight gradients to `store`) run ZB-H1 for training; returns it."""
        if type(engine) is not PipelineEngine:
            raise TypeError(f"ZB-H1 runs on DeepSpeed's PipelineEngine, not {type(engine).__name__}")
        if engine.is_pipe_partitioned != engine.is_grad_partitioned:
            raise ValueError("ZB-H1 needs DeepSpeed's pipeline.pipe_partitioned and pipeline.grad_partitioned "
                             "to be equal")
        if engine.has_attention_mask or engine.has_bool_tensors:
            raise ValueError("ZB-H1 sends no boolean tensors between stages")
        if engine.using_bf16_optimizer and engine.optimizer.immediate_grad_update:
            raise ValueError("ZB-H1 adds W's gradients to the fp32 ones itself: bf16.immediate_grad_update must be off")
        engine.__class__ = cls
        engine.weight_grads, engine.zb_costs = store, costs
        engine._recvs, engine._sends, engine._losses = {}, [], {}
        engine._fp32_index = {}  # bf16 parameter → (group, index) of its fp32 gradient in the bf16 optimizer
        if engine.using_bf16_optimizer:
            engine._fp32_index = {p: (i, j) for i, group in enumerate(engine.optimizer.bf16_groups)
                                  for j, p in enumerate(group)}
        return engine

    def _train_schedule(self):
        return ZeroBubbleH1(self.micro_batches, self.num_stages, self.stage_id, self.zb_costs)

    def _exec_schedule(self, pipe_schedule):
        if not isinstance(pipe_schedule, ZeroBubbleH1):  # evaluation: DeepSpeed's own schedule
            return super()._exec_schedule(pipe_schedule)
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        for step in pipe_schedule:
            for cmd in step:
                run = self._ZB_INSTRUCTIONS.get(type(cmd)) or PipelineEngine._INSTRUCTION_MAP[type(cmd)]
                run(self, **cmd.kwargs)

    # ---- receives ----

    def _exec_post_recv_activation(self, buffer_id: int) -> None:
        if self.pipe_recv_buf is None:  # the first message: its shapes and dtypes first (DeepSpeed's protocol)
            self.pipe_recv_buf = self._recv_tensor_meta(self.prev_stage)
        template = self.pipe_recv_buf if isinstance(self.pipe_recv_buf, tuple) else (self.pipe_recv_buf,)
        buffers = []
        for index, like in enumerate(template):
            if self.is_pipe_partitioned and index == 0 and like.dtype != torch.long:  # the partition's metadata
                buffers.append(torch.zeros(like.size(), dtype=torch.long, device=self.device))
            else:
                buffers.append(torch.empty_like(like))
        self._post_receives("act", buffer_id, buffers, self.prev_stage)

    def _exec_post_recv_grad(self, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        if self.is_grad_partitioned:  # (partition metadata, this rank's part)
            buffers = [torch.zeros(outputs[0].size(), dtype=torch.long, device=self.device),
                       torch.empty_like(outputs[1])]
            buffers += [torch.empty_like(t) for t in outputs[2:] if t.is_floating_point()]
        else:
            buffers = [torch.empty_like(t) for t in outputs if t.is_floating_point()]
        self._post_receives("grad", buffer_id, buffers, self.next_stage)

    def _post_receives(self, what: str, buffer_id: int, buffers: list, stage: int) -> None:
        source = self.grid.stage_to_global(stage_id=stage)
        self._recvs[(what, buffer_id)] = (buffers, [dist.irecv(buffer, source) for buffer in buffers])

    def _received(self, what: str, buffer_id: int) -> list:
        buffers, works = self._recvs.pop((what, buffer_id))
        for work in works:
            work.wait()
        return buffers

    # ---- sends ----

    def _send(self, tensors, stage: int) -> None:
        destination = self.grid.stage_to_global(stage_id=stage)
        self._sends += [(dist.isend(tensor, destination), tensor) for tensor in tensors]

    def _release_sends(self) -> None:
        """Wait for the sends issued so far, so their tensors can be freed (gloo reports a send complete only
        once waited on). Each has its receive posted by now: a stage posts a link's receive right after its
        previous message on that link, which the predicted timeline puts no later than the send, and so on
        no pass that follows this one."""
        for work, _ in self._sends:
            work.wait()
        self._sends = []

    def _exec_send_activations_async(self, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if self.first_output_send:
            self.first_output_send = False
            self._send_tensor_meta(outputs, self.next_stage)
        self._send(outputs if isinstance(outputs, tuple) else (outputs,), self.next_stage)

    def _exec_send_grads_async(self, buffer_id: int) -> None:
        inputs = self.pipe_buffers["inputs"][buffer_id]
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        if self.is_grad_partitioned:
            part = PartitionedTensor(tensor=inputs[0].grad, group=self.grid.get_slice_parallel_group())
            grads = [part.to_meta(), part.data()]
        else:
            grads = [t.grad for t in inputs if t.is_floating_point()]
        self.pipe_buffers["inputs"][buffer_id] = None
        self._send(grads, self.prev_stage)

    def _exec_wait_sends(self) -> None:
        self._release_sends()
        if self._recvs:
            raise RuntimeError(f"receives posted and never used: {sorted(self._recvs)}")
        self.weight_grads.check_drained()

    # ---- passes ----

    def _exec_forward(self, buffer_id: int) -> None:
        self._release_sends()
        if not self.is_first_stage():
            received = self._received("act", buffer_id)
            for tensor in received:
                tensor.requires_grad = tensor.is_floating_point()
            self.pipe_buffers["inputs"][buffer_id] = tuple(received) if len(received) > 1 else received[0]
        PipelineEngine._exec_forward_pass(self, buffer_id)
        if self.is_last_stage():
            self._losses[buffer_id] = self.loss

    def _exec_input_grad_pass(self, buffer_id: int) -> None:
        self._release_sends()
        if self.is_last_stage():
            self.loss = self._losses.pop(buffer_id)
        else:
            self.grad_layer = self._received("grad", buffer_id)
        PipelineEngine._exec_backward_pass(self, buffer_id)
        self.weight_grads.seal()

    def _exec_weight_grad_pass(self) -> None:
        self._release_sends()
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

    _ZB_INSTRUCTIONS = {
        PostRecvActivation: _exec_post_recv_activation,
        PostRecvGrad: _exec_post_recv_grad,
        SendActivationAsync: _exec_send_activations_async,
        SendGradAsync: _exec_send_grads_async,
        Forward: _exec_forward,
        InputGradPass: _exec_input_grad_pass,
        WeightGradPass: _exec_weight_grad_pass,
        WaitSends: _exec_wait_sends,
    }
