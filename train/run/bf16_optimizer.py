"""DeepSpeed's bf16 optimizer with its per-step work on the device, in a few kernels.

Under train.precision=bf16 (and fp8) at ZeRO stage ≤ 1 DeepSpeed wraps our AdamW in its BF16_Optimizer
(deepspeed/runtime/bf16_optimizer.py): fp32 master weights and an fp32 gradient for every bf16 parameter,
each a view of one flat buffer per parameter group (the checkpoints read them there). As DeepSpeed writes
its step, it adds each bf16 gradient to its fp32 one as a cast and then an add (two kernels a parameter),
takes ‖g‖ as one norm kernel a parameter, reads back to the host whether ‖g‖ is finite (a `bool()`: the
GPU's queue drains before the next step can be issued), and all-gathers the updated bf16 weights over the
data-parallel group even when the group is this one process.

`DeviceStepBF16` (`adopt` puts it on the engine's optimizer, keeping every buffer and mapping DeepSpeed set
up) changes only these:
  - a bf16 gradient is added to its fp32 one in one kernel (the add casts as it reads: `_update_hp_grad`);
    with `bf16.immediate_grad_update` (train/run/engine.py, one pipeline stage) DeepSpeed's own hooks do
    it as backward makes each gradient and drop the bf16 one, so no bf16 gradient is kept or zeroed;
  - ‖g‖ is one multi-tensor norm over the flat fp32 gradient buffers when every gradient there counts toward
    it (tensor-parallel rank 0, no pipeline-replicated copy), else over the gradients that count
    (train/run/optimizer.py: norm_of); it stays on the device as `device_norm` (NaN or inf when not
    finite), and our ClippingAdamW (GIVEN_NORM) clips by it and skips the update on the device;
    `overflow` stays False on the host (the loop reads the skip later: train/guard/safeguards.py);
  - the updated bf16 weights are all-gathered only when the data-parallel group has other ranks, and the
    fp32 gradients are zeroed once a step, not twice (the engine's zero_grad after the step zeroes them
    again).
"""

from __future__ import annotations

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

from train.run.optimizer import norm_of


class DeviceStepBF16(BF16_Optimizer):
    """BF16_Optimizer with the step of the module docstring; made by `adopt`, never constructed."""

    device_norm: torch.Tensor | None = None  # this step's ‖g‖, on the device
    hp_grads_clear = False  # the fp32 gradients are zero (nothing added since they were zeroed)

    @torch.no_grad()
    def _update_hp_grad(self, lp, group_idx, param_idx, clear_lp_grads):
        if lp.grad is None:
            return
        hp_grad = self.fp32_groups_gradients[group_idx][param_idx]
        hp_grad.add_(lp.grad.view(hp_grad.shape))  # fp32 += bf16, cast as it reads: one kernel
        self.hp_grads_clear = False
        lp._hp_grad = hp_grad
        self.fp32_groups_has_gradients[group_idx][param_idx] = True
        if clear_lp_grads:
            lp.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise NotImplementedError(f"{type(self).__name__} does not take a closure")
        self.overflow = False  # decided on the device: the host cannot know without a read
        self.device_norm = self._global_grad_norm = norm_of(self._grads_for_norm(), self.mpu)  # inf, NaN: skipped
        for param_partition, grad_partition in zip(self.fp32_groups_flat_partition,
                                                   self.fp32_groups_gradient_flat_partition):
            param_partition.grad = grad_partition
        self.optimizer.step()  # ClippingAdamW (GIVEN_NORM): clips by device_norm, skips when it is not finite
        self._lazy_init_hp_params_optimizer_state()
        self.update_lp_params()
        self.clear_hp_grads()

    def clear_hp_grads(self):
        """Zero the fp32 gradients unless nothing was added since they were last zeroed (the engine's zero_grad
        follows every step, which zeroes them itself: DeepSpeed's bf16 optimizer zeroes them twice a step)."""
        if not self.hp_grads_clear:
            super().clear_hp_grads()
            self.hp_grads_clear = True

    def _grads_for_norm(self) -> list[torch.Tensor]:
        """The flat fp32 gradient buffers when every gradient in them counts toward ‖g‖ on this rank (their
        padding is zero), else the gradients that count, as DeepSpeed chooses them."""
        from deepspeed.runtime.utils import bwc_tensor_model_parallel_rank

        replicated = any(getattr(lp, "ds_pipe_replicated", False) for group in self.bf16_groups for lp in group)
        if bwc_tensor_model_parallel_rank(mpu=self.mpu) == 0 and not replicated:
            return list(self.fp32_groups_gradients_flat)
        return self.get_grads_for_norm()[0]

    @torch.no_grad()
    def update_lp_params(self):
        import torch.distributed as dist

        if all(dist.get_world_size(group=group) == 1 for group in self.real_dp_process_group):
            for bf16_partitions, fp32_partition in zip(self.bf16_partitioned_groups, self.fp32_groups_flat_partition):
                bf16_partitions[0].copy_(fp32_partition)  # the whole group: nothing to gather
            return
        super().update_lp_params()


def adopt(optimizer: BF16_Optimizer) -> DeviceStepBF16:
    """The engine's BF16_Optimizer, as set up by DeepSpeed, now stepping as DeviceStepBF16 (same object)."""
    optimizer.__class__ = DeviceStepBF16
    return optimizer
