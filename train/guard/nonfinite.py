"""Non-finite steps: skipped on every rank and counted; a run that keeps skipping stops; no checkpoint
ever holds non-finite weights.

How a step is skipped. Every optimizer gpt3d trains with computes the gradient's global L2 norm ‖g‖
(one number, the same on every rank) before it updates, and skips the update when ‖g‖ is not finite:
ClippingAdamW at ZeRO-0 and inside DeepSpeed's bf16 optimizer at ZeRO ≤ 1 (train/run/optimizer.py,
train/run/bf16_optimizer.py: decided on the device, by fused AdamW's found_inf), DeepSpeed's ZeRO-1/2/3
optimizers (always for fp32 weights, by `bf16.check_grad_overflow`, default on, for bf16 ones; decided on
the host) and DeepSpeed's fp16 loss scaler. A skipped update changes no weight, no Adam moment and no step
count. A skip decided on the host, the optimizer says `overflow`, and DeepSpeed's engine leaves the LR
schedule where it was and counts `engine.skipped_steps`; one decided on the device, the loop counts it and
takes its tokens back from the LR schedule when it reads the step's flag (train/guard/safeguards.py). The
count is saved in checkpoints, so it survives a resume.

A loss that is not finite reaches ‖g‖ on every rank through `flag_non_finite`
(model/layers.py, applied by the model's Head to the loss it returns, so also inside a pipeline's
last stage): the loss is multiplied by 1 when it is finite and by NaN when it is not, before
backward, so that rank's whole gradient is NaN. The data-parallel gradient reduction spreads NaN to every data-parallel rank and the norm's sum
over the model-parallel group to every stage and tensor-parallel rank: the ranks agree on the skip
through collectives the step makes anyway. For a finite loss the factor is exactly 1, so the
gradient (and the run) is bit for bit what it was without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LIKELY_CAUSES = (
    "a learning rate too high for this model and batch (lower optim.lr or lengthen optim.warmup_tokens)",
    "bad or unusual data in these batches",
    "fp16 overflow (train in bf16)",
)


@dataclass
class SkipCounter:
    """Skipped steps: in all (this run directory's, the engine's count) and in a row (since this start)."""

    limit: int  # train.max_consecutive_skips
    total: int = 0
    in_a_row: int = 0
    first_in_a_row: int | None = None  # the step that began the current run of skips
    last: int = 0  # the last step counted

    def update(self, step: int, skipped: bool, total: int) -> None:
        self.total, self.last = total, step
        if not skipped:
            self.in_a_row, self.first_in_a_row = 0, None
            return
        self.in_a_row += 1
        if self.first_in_a_row is None:
            self.first_in_a_row = step

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.limit


class NonFiniteError(RuntimeError):
    """The run cannot go on: too many skipped steps, or weights that are not finite."""


def skip_line(step: int, loss: float, grad_norm: float | None, counter: SkipCounter) -> str:
    """The line printed for each skipped step."""
    norm = "?" if grad_norm is None else f"{grad_norm:.4g}"
    return (f"step {step}: loss {loss:.4g}, gradient norm {norm}: not finite, step skipped on every rank "
            f"(no weight, optimizer or LR change); {counter.in_a_row} in a row, {counter.total} in this run")


def too_many_skips(step: int, counter: SkipCounter, weights_ok: bool, last_checkpoint: str | None) -> NonFiniteError:
    """The error that stops a run after train.max_consecutive_skips skipped steps in a row."""
    first = counter.first_in_a_row
    since = (f"the weights are those after step {first - 1}" if weights_ok
             else "and the weights themselves are not finite (an earlier update overflowed)")
    causes = "; ".join(LIKELY_CAUSES)
    resume = (f"Once the cause is fixed, resume from the last checkpoint, {last_checkpoint} (a changed optim.lr "
              f"needs train.reset_schedule=true)" if last_checkpoint else "No checkpoint was written yet")
    return NonFiniteError(
        f"stopped at step {step}: steps {first}–{step} ({counter.in_a_row} in a row, train.max_consecutive_skips="
        f"{counter.limit}) had a non-finite loss or gradient norm and were skipped; {since}. Likely causes: "
        f"{causes}. {resume}."
    )


def non_finite_parameters(module: torch.nn.Module) -> list[str]:
    """Names of this rank's parameters holding inf or nan (ZeRO-3: the rank's partition of each)."""
    found = []
    for name, param in module.named_parameters():
        held = getattr(param, "ds_tensor", None)  # ZeRO-3 keeps this rank's partition here, `data` empty
        values = held if held is not None else param.detach()
        if values.numel() and not bool(torch.isfinite(values).all()):
            found.append(name)
    return found


def count_over_ranks(count: int, device: torch.device) -> int:
    """The sum of a per-rank count over all ranks (on NCCL the tensor must live on the GPU)."""
    import torch.distributed as dist

    total = torch.tensor([count], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return int(total.item())


def refuse_to_save(step: int, bad: list[str], ranks_with_bad: int, last_checkpoint: str | None) -> NonFiniteError:
    """The error when a checkpoint would hold non-finite weights."""
    example = f" (on this rank: {', '.join(bad[:3])}{', …' if len(bad) > 3 else ''})" if bad else ""
    kept = f"the last checkpoint, {last_checkpoint}, is untouched" if last_checkpoint else "no checkpoint was written"
    return NonFiniteError(
        f"step {step}: refusing to write a checkpoint: the weights are not finite on {ranks_with_bad} rank(s)"
        f"{example}; {kept}. An update overflowed: likely causes: {'; '.join(LIKELY_CAUSES)}."
    )
