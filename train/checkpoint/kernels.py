"""The attention kernels' autotuned choices as a per-rank checkpoint part (model/kernel_choices.py).

Saved under `kernels` in the rank's entry of rng.json when the process tuned any (a CPU run, or one
with autotuning off, has none: nothing is written); put back before the resumed process's first step,
so its kernels run the configs its run tuned and sum in the same order."""

from __future__ import annotations

from model.kernel_choices import attention_choices, pin_attention_choices


class KernelChoices:
    """This process's autotuned kernel choices, registered as a per-rank part."""

    def state_dict(self) -> dict:
        choices = attention_choices()
        return {"kernels": choices} if choices else {}

    def load_state_dict(self, state: dict) -> None:
        pin_attention_choices(state.get("kernels", {}))
