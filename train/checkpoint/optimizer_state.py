"""One parameter's training state, whole, at any ZeRO stage: fp32 master weights and Adam moments.

A checkpoint stores, for every parameter this rank holds (a tensor-parallel shard of a full-model
tensor, parallel/naming.py), three tensors of its local shape: the fp32 master weights and AdamW's
`exp_avg` and `exp_avg_sq`; plus AdamW's step count, one number for the whole model. Where they
live depends on the ZeRO stage:

  ZeRO-0        our ClippingAdamW (a torch AdamW) steps the module's parameters: the parameter is
                its own fp32 master (also under bf16 autocast) and `optimizer.state[p]` holds the
                moments.
  ZeRO-1/2/3    DeepSpeed's ZeRO optimizer keeps flat fp32 partitions over the data-parallel ranks
  (± offload)   (on the CPU with offload) and runs the same AdamW on them. DeepSpeed's
                `safe_get_full_fp32_param` / `safe_get_full_optimizer_state` gather one
                parameter's partitions (an all-reduce over the data-parallel group, so every dp
                rank calls them for the same parameters in the same order), and the `safe_set_full_*`
                twins write back each rank's own fragment of a whole value.

`ParameterState(engine)` hides the difference: `get(p)` → {"model", "exp_avg", "exp_avg_sq"} and
`set_(p, values)`. A fresh optimizer has no state before its first step (torch creates it lazily);
`ensure_state()` creates exactly what torch's AdamW would (step 0, zero moments) so that a loaded
state has somewhere to go.
"""

from __future__ import annotations

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")
KINDS = ("model", *MOMENTS)  # the tensors saved per parameter: fp32 master weights, Adam moments


class ParameterState:
    """Read and write parameters' fp32 weights and Adam moments through a DeepSpeed engine."""

    def __init__(self, engine):
        optimizer = engine.optimizer
        self.wrapper = optimizer if hasattr(optimizer, "optimizer") else None  # DeepSpeed's ZeRO (or bf16) optimizer
        self.adam = optimizer.optimizer if self.wrapper is not None else optimizer  # the torch AdamW that steps
        self.zero_stage = engine.zero_optimization_stage()

    @staticmethod
    def _by_deepspeed(param) -> bool:
        """DeepSpeed holds this parameter's fp32 master and moments (partitioned over dp)."""
        return hasattr(param, "_hp_mapping") or hasattr(param, "ds_id")

    def get(self, param) -> dict[str, torch.Tensor]:
        """{"model": fp32 weights, "exp_avg", "exp_avg_sq"}, each of the local (tp shard) shape; a
        collective over the data-parallel group when DeepSpeed partitions the state."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        shape = tuple(getattr(param, "ds_shape", param.shape))
        if self._by_deepspeed(param):
            values = {"model": safe_get_full_fp32_param(param)}
            values.update({key: safe_get_full_optimizer_state(param, key) for key in MOMENTS})
        else:
            state = self.adam.state[param]
            values = {"model": param.detach(), **{key: state[key] for key in MOMENTS}}
        return {key: value.reshape(shape).float() for key, value in values.items()}

    @torch.no_grad()
    def set_(self, param, values: dict[str, torch.Tensor]) -> None:
        """Write whole values (local shape) into the module's parameter, the fp32 master and the
        moments; a collective over the data-parallel group at ZeRO-3."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        weights = values["model"]
        if self.zero_stage == 3:
            from deepspeed.runtime.zero import GatheredParameters

            with GatheredParameters([param], modifier_rank=0):  # rank 0 of the dp group's copy is kept
                param.data.copy_(weights.reshape(param.shape).to(param.device, param.dtype))
        else:
            param.data.copy_(weights.to(param.device, param.dtype))
        if self._by_deepspeed(param):
            safe_set_full_fp32_param(param, weights.to(param.device))
            for key in MOMENTS:
                safe_set_full_optimizer_state(param, values[key].to(param.device), key)
        else:
            state = self.adam.state[param]
            for key in MOMENTS:
                state[key].copy_(values[key])

    def ensure_state(self) -> None:
        """Give every parameter the optimizer steps (module parameters, or DeepSpeed's flat fp32
        partitions) the state torch's AdamW creates at its first step, where it has none yet."""
        # ZeRO-3 puts its flat partitions into the param groups only while it steps them.
        stepped = getattr(self.wrapper, "fp32_partitioned_groups_flat", None)
        if stepped is None:
            stepped = [p for group in self.adam.param_groups for p in group["params"]]
        on_device = self.adam.defaults.get("capturable", False) or self.adam.defaults.get("fused", False)
        for p in stepped:
            state = self.adam.state[p]
            if state:
                continue
            state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if on_device
                             else torch.tensor(0.0, dtype=torch.float32))
            for key in MOMENTS:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        # ZeRO-1/2 link each parameter's fragments of the flat state (what safe_*_optimizer_state
        # read and write) once, after the first step of the first param group, before the other
        # groups have any state (DeepSpeed 0.19 steps group by group): link again, now that all have.
        link = getattr(self.wrapper, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:
            self.wrapper._hp_optimizer_states_linked = False
            link()

    def step_count(self) -> int:
        """AdamW's step count (its bias correction): the same for every parameter."""
        counts = {float(state["step"]) for state in self.adam.state.values() if "step" in state}
        if len(counts) > 1:
            raise RuntimeError(f"the optimizer's parameters have taken different numbers of steps: {sorted(counts)}")
        return int(counts.pop()) if counts else 0

    def set_step_count(self, steps: int) -> None:
        for state in self.adam.state.values():
            state["step"].fill_(steps)
