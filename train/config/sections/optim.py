"""`optim.*`: AdamW as in GPT-3 (β = (0.9, 0.95), ε = 1e-8, weight decay 0.1 on matrices only, clipping at
1.0) and its learning-rate schedule, linear warmup then cosine decay to min_lr_ratio·lr, both measured in
tokens (train/run/optimizer.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from train.config.settings import Check, Section, is_number, number, setting

BETAS = Check(lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(is_number(b) and 0 <= b < 1 for b in v),
              "must be two numbers in [0, 1)")


@dataclass
class OptimConfig(Section):
    """`optim.*` (see the module docstring)."""

    PREFIX: ClassVar[str] = "optim"
    lr: Any = setting(None, "peak learning rate; null: the GPT-3 paper's for the model size (toy: 3e-3)",
                      Check(lambda v: v is None or (is_number(v) and v > 0), "must be null or > 0"))
    betas: Any = setting(doc="AdamW's β₁, β₂", check=BETAS, factory=lambda: [0.9, 0.95])
    eps: Any = setting(1.0e-8, "AdamW's ε", number(0, low_open=True, text="> 0"))
    weight_decay: Any = setting(0.1, "decoupled weight decay, on matrices only", number(0, text="≥ 0"))
    grad_clip: Any = setting(1.0, "the global gradient norm is clipped to this", number(0, text="≥ 0 (0: no clipping)"))
    warmup_tokens: Any = setting(375_000_000, "linear warmup, in tokens (GPT-3: 375M); the default is capped at 10% "
                                              "of the run's tokens so a short run still decays; a value set on the "
                                              "command line is used as given (refused if it does not end before the "
                                              "decay horizon)", number(0, text="≥ 0"))
    decay_tokens: Any = setting(None, "cosine decay horizon in tokens; null: the run's tokens (max_steps · "
                                      "global_batch_size · seq_len; fewer under a batch ramp)")
    min_lr_ratio: Any = setting(0.1, "the decay's floor, as a share of the peak", number(0, 1, text="in [0, 1]"))
