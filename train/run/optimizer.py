"""AdamW with GPT-3's settings and its token-based learning-rate schedule.

Schedule, as a function of tokens seen τ (GPT-3 §B): with peak η, warmup W and decay horizon D,
  η(τ) = η · τ / W                                              for τ < W
  η(τ) = η · (r + (1 − r) · ½ · (1 + cos(π · (τ − W) / (D − W))))   for W ≤ τ < D
  η(τ) = η · r                                                  for τ ≥ D
where r = min_lr_ratio (0.1: decay to 10% of the peak).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from train.config.sections import OptimConfig

# Peak learning rates of Table 2.1 of the GPT-3 paper, by config name; the toy's is ours.
PAPER_PEAK_LR = {
    "toy": 3e-3,
    "gpt3-125m": 6.0e-4,
    "gpt3-350m": 3.0e-4,
    "gpt3-760m": 2.5e-4,
    "gpt3-1.3b": 2.0e-4,
    "gpt3-2.7b": 1.6e-4,
    "gpt3-6.7b": 1.2e-4,
    "gpt3-13b": 1.0e-4,
    "gpt3-175b": 0.6e-4,
}


@dataclass(frozen=True)
class Schedule:
    """Linear warmup then cosine decay to a floor, in tokens (see module docstring)."""

    peak_lr: float
    warmup_tokens: int
    decay_tokens: int
    min_lr_ratio: float

    def lr_at(self, tokens: int) -> float:
        if tokens < self.warmup_tokens:
            return self.peak_lr * tokens / self.warmup_tokens
        if tokens >= self.decay_tokens:
            return self.peak_lr * self.min_lr_ratio
        progress = (tokens - self.warmup_tokens) / (self.decay_tokens - self.warmup_tokens)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak_lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)


def resolve_peak_lr(optim_cfg: OptimConfig, model_name: str) -> float:
    """optim.lr, or the paper's peak LR for this model size when optim.lr is null."""
    if optim_cfg.lr is not None:
        return float(optim_cfg.lr)
    if model_name not in PAPER_PEAK_LR:
        raise ValueError(
            f"optim.lr is null and model.name={model_name!r} has no paper LR; set optim.lr "
            f"(paper LRs exist for {sorted(PAPER_PEAK_LR)})"
        )
    return PAPER_PEAK_LR[model_name]


def make_schedule(optim_cfg: OptimConfig, model_name: str, run_tokens: int, warmup_set: bool = False) -> Schedule:
    """The schedule of a run of `run_tokens` tokens (with a batch ramp, BatchRamp.tokens_after(max_steps)).

    optim.warmup_tokens as the user set it (`warmup_set`) is used as given; its default (GPT-3's 375M) is
    capped at 10% of the run, so that a short run still decays. The decay horizon is optim.decay_tokens, or
    the run's tokens; ValueError, naming the values, when the warmup does not end before it."""
    decay = int(optim_cfg.decay_tokens) if optim_cfg.decay_tokens is not None else run_tokens
    warmup = int(optim_cfg.warmup_tokens) if warmup_set else min(int(optim_cfg.warmup_tokens), max(run_tokens // 10, 1))
    if decay <= warmup:
        horizon = (f"optim.decay_tokens={decay:,}" if optim_cfg.decay_tokens is not None
                   else f"the run's {decay:,} tokens (the decay horizon when optim.decay_tokens is null)")
        if warmup_set:
            raise ValueError(
                f"optim.warmup_tokens={warmup:,} does not end before {horizon}: the learning rate would never "
                f"decay; lower optim.warmup_tokens, raise optim.decay_tokens or train.max_steps, or leave "
                f"optim.warmup_tokens out (its default warms up over at most 10% of the run)"
            )
        raise ValueError(f"the default warmup ({warmup:,} tokens: GPT-3's 375M, at most 10% of the run) does not end "
                         f"before {horizon}; raise optim.decay_tokens, or set optim.warmup_tokens")
    return Schedule(resolve_peak_lr(optim_cfg, model_name), warmup, decay, float(optim_cfg.min_lr_ratio))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (dim ≥ 2: linear weights, embeddings) only; none on biases or LayerNorm."""
    decay, no_decay = [], []
    for param in model.parameters():  # unique parameters: the tied matrix appears once
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# Who clips the gradient (train/run/engine.py: clipping decides for a run):
OWN_NORM = "own norm"  # ClippingAdamW computes ‖g‖, skips a non-finite step and clips (ZeRO stage 0)
GIVEN_NORM = "given norm"  # the optimizer around ours computes ‖g‖ (train/run/bf16_optimizer.py); ClippingAdamW clips (and skips)
ELSEWHERE = "elsewhere"  # plain AdamW: DeepSpeed's ZeRO optimizer (or the caller) computes, skips and clips


class ClippingAdamW(torch.optim.AdamW):
    """torch's fused AdamW that first clips the gradients to a global L2 norm,
    g ← g · min(1, max_norm / (‖g‖ + 1e-6)), and skips the whole update when ‖g‖ is not finite, all decided
    on the device: a step reads nothing back.

    The skip is fused AdamW's own `found_inf` (1.0: no weight, moment or step count changes; torch's
    GradScaler uses the same input), set from ‖g‖ each step and kept as `skipped`, a 0-d float tensor on the
    device, which the training step reports (train/run/step.py) and the loop reads when it logs or one step
    later (train/guard/). DeepSpeed's engine is told no step overflowed (`overflow` stays False on the host:
    the engine cannot know without a read), so it counts no skip and moves its LR schedule on; the loop
    takes both back once it reads the skip (train/guard/safeguards.py). The clip factor is computed and
    applied on the device too; a factor ≥ 1 multiplies by exactly 1, as DeepSpeed's own clip does.

    clip=OWN_NORM: ‖g‖ over the whole model whatever the layout (see `global_grad_norm`), recorded
    (pre-clip; inf or NaN when not finite) as `_global_grad_norm`, where DeepSpeed's engines read it after each step;
    max_norm = 0 measures without clipping. The norm is the same on every rank, so every rank skips alike.
    Used at ZeRO stage 0 in fp32 and autocast.

    clip=GIVEN_NORM: inside DeepSpeed's bf16 optimizer (train.precision=bf16, ZeRO stage ≤ 1), which
    computes ‖g‖ over its fp32 gradients and hands it over (`take_norm_from`) before calling this one.

    clip=ELSEWHERE: plain fused AdamW; DeepSpeed's ZeRO optimizer (or the caller) clips and skips.
    """

    def __init__(self, params, max_norm: float, clip: str = OWN_NORM, mpu=None, **adamw_kwargs):
        super().__init__(params, fused=True, **adamw_kwargs)
        self.max_norm, self.clip, self.mpu = max_norm, clip, mpu
        self._global_grad_norm = None
        self.overflow = False
        self.skipped = None  # this step's skip, a 0-d float tensor on the device (OWN_NORM, GIVEN_NORM)
        self._norm_holder = None

    def take_norm_from(self, holder) -> None:
        """clip=GIVEN_NORM: the optimizer around this one, whose ‖g‖ is its `device_norm` (DeepSpeed's bf16 optimizer
        as gpt3d runs it, train/run/bf16_optimizer.py) or its `_global_grad_norm` (DeepSpeed's ZeRO-1 optimizer with
        offload, which skips a non-finite step on the host before calling this one) when step runs."""
        self._norm_holder = holder

    def _given_norm(self, device: torch.device) -> torch.Tensor:
        norm = getattr(self._norm_holder, "device_norm", None)
        return norm if norm is not None else torch.as_tensor(self._norm_holder._global_grad_norm, device=device)

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if self.clip == ELSEWHERE or not params:
            return super().step(closure)
        norm = self._given_norm(params[0].device) if self.clip == GIVEN_NORM else global_grad_norm(params, self.mpu)
        bad = (norm - norm) != 0  # 0-d, on the device: ‖g‖ − ‖g‖ is NaN exactly when ‖g‖ is inf or NaN
        self.skipped = self.found_inf = bad.float()  # fused AdamW's skip: found_inf ≠ 0 changes nothing
        if self.clip == OWN_NORM:
            self._global_grad_norm = norm  # pre-clip, where DeepSpeed's engine reads it (inf or NaN: skipped)
        if self.max_norm > 0:
            factor = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)  # ≥ 1 → exactly 1
            torch._foreach_mul_([p.grad for p in params], torch.where(bad, 1.0, factor))
        return super().step(closure)


def global_grad_norm(params: list[torch.Tensor], mpu=None) -> torch.Tensor:
    """‖g‖₂ of the whole model's gradient from this rank's parameters, equal on every rank: a 0-d fp32 tensor
    on the device (nothing is read back).

    Each rank squares what it alone holds: tensor-parallel shards (`model_parallel`) on every tp
    rank, replicated parameters on tp rank 0 only, and a pipeline-tied matrix only on the stage that
    owns it (DeepSpeed marks the other copies `ds_pipe_replicated`); the squares are summed over the
    model-parallel (pp × tp) group, as DeepSpeed's `get_global_norm_of_tensors` sums them. Each tensor's
    norm comes from one multi-tensor kernel (torch._foreach_norm, in fp32), not one kernel a tensor.
    """
    from deepspeed.runtime.utils import is_model_parallel_parameter

    tp_rank = mpu.get_slice_parallel_rank() if mpu is not None else 0
    grads = [
        p.grad
        for p in params
        if not getattr(p, "ds_pipe_replicated", False) and (tp_rank == 0 or is_model_parallel_parameter(p))
    ]
    return norm_of(grads, mpu, params[0].device if params else torch.device("cpu"))


def norm_of(tensors: list[torch.Tensor], mpu=None, device: torch.device | None = None) -> torch.Tensor:
    """‖(t₁, …, tₙ)‖₂ as one vector, the squares summed over the model-parallel group (when it has other
    ranks): a 0-d fp32 tensor on the device, inf or NaN when any element is not finite. Every tensor's norm
    comes from one multi-tensor kernel (torch._foreach_norm, in fp32), not a kernel each."""
    import torch.distributed as dist

    group = mpu.get_model_parallel_group() if mpu is not None else None
    if not tensors:
        norms = torch.zeros(1, device=device)
    else:
        norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))  # (n,) each tensor's
    if group is None or dist.get_world_size(group) == 1:
        return torch.linalg.vector_norm(norms)
    squares = norms.square().sum()  # (), this rank's share of ‖g‖²
    dist.all_reduce(squares, group=group)
    return squares.sqrt()


def make_optimizer(model: nn.Module, optim_cfg: OptimConfig, peak_lr: float, clip: str = OWN_NORM, mpu=None) -> ClippingAdamW:
    """GPT-3's AdamW, clipping as `clip` says (see ClippingAdamW)."""
    return ClippingAdamW(
        param_groups(model, float(optim_cfg.weight_decay)),
        max_norm=float(optim_cfg.grad_clip),
        clip=clip,
        mpu=mpu,
        lr=peak_lr,
        betas=tuple(optim_cfg.betas),
        eps=float(optim_cfg.eps),
    )


class TokenLR:
    """The learning rate as a function of tokens trained on, for DeepSpeed's `lr_scheduler` slot.

    τ counts the tokens of the updates applied so far. Before each optimizer step the loop calls
    `next_step(b)` with the step's batch in tokens, and every parameter group gets η(τ + b), the rate
    at the tokens trained on once the step is done; so the first step already has a non-zero rate, and
    with a constant batch of b tokens step s (0-based) runs at η((s + 1)·b). DeepSpeed calls `step()`
    after an update it takes as applied, which adds b to τ (not after one its ZeRO optimizers skipped on the
    host); one our optimizers skipped on the device is taken back once the loop reads its flag
    (`take_back`): a skipped step leaves the schedule where it was. (Read one step late, the step after it
    has already run at the rate of b more tokens: b/τ of the schedule, a few millionths at GPT-3's scale.) The rate follows the tokens trained on also when the
    batch grows (train/run/batch_ramp.py) and after a resume (the checkpoint restores τ). Its state (τ) is
    plain data. `set_tokens(τ)` sets τ itself, with the rate η(τ).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Schedule, first_step_tokens: int):
        self.optimizer, self.schedule = optimizer, schedule
        self.set_tokens(0)
        self.next_step(first_step_tokens)

    def next_step(self, batch_tokens: int) -> None:
        self._pending = int(batch_tokens)
        self._apply(self.tokens + self._pending)

    def set_tokens(self, tokens: int) -> None:
        self.tokens, self._pending = int(tokens), 0
        self._apply(self.tokens)

    def _apply(self, tokens: int) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.schedule.lr_at(tokens)

    def step(self) -> None:
        """DeepSpeed's call after an update it takes as applied: its tokens now count as trained on."""
        self.tokens += self._pending
        self._pending = 0

    def take_back(self, batch_tokens: int) -> None:
        """An update DeepSpeed took as applied was skipped on the device (train/guard/safeguards.py learns it
        when it reads the step's flag, at once when the step logs or saves, else one step later): its tokens
        no longer count, and the rate is that of the tokens trained on (and of a step announced since)."""
        self.tokens -= int(batch_tokens)
        self._apply(self.tokens + self._pending)

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.set_tokens(state["tokens"])
