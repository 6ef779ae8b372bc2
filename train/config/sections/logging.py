"""`logging.*`: the metrics records (metrics.jsonl, W&B, TensorBoard) and the progress lines (train/monitor/metrics.py),
and the curves a run draws at its end (train/monitor/charts.py)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar

from train.config.settings import BOOLEAN, OPTIONAL_TEXT, POSITIVE_INT, Check, Section, is_number, one_of, setting

WANDB_MODES = ("offline", "online", "disabled")
TENSORBOARD = Check(lambda v: v is False or (v is True and importlib.util.find_spec("tensorboard") is not None),
                    "must be false unless the tensorboard package is installed (pip install -e '.[tensorboard]')")
WORDS = Check(lambda v: isinstance(v, (list, tuple)) and all(isinstance(t, str) and t for t in v),
              "must be a list of words, e.g. 'logging.wandb.tags=[baseline,125m]'")


@dataclass
class WandbConfig(Section):
    """`logging.wandb.*`: the Weights & Biases run. The text fields are untyped at composition so that a
    number (logging.wandb.group=5) is refused as not text rather than turned into one."""

    PREFIX: ClassVar[str] = "logging.wandb"
    mode: str = setting("offline", "`offline` (no account needed), `online` (needs WANDB_API_KEY), `disabled`",
                        one_of(*WANDB_MODES))
    project: Any = setting("gpt3d", "the W&B project", OPTIONAL_TEXT)
    entity: Any = setting(None, "the W&B entity (user or team)", OPTIONAL_TEXT)
    name: Any = setting(None, "the W&B run name; null: <model>-tp<tp>pp<pp>dp<dp>-<run folder name>",
                                  OPTIONAL_TEXT)
    group: Any = setting(None, "runs compared together (e.g. a sweep, an ablation)", OPTIONAL_TEXT)
    tags: Any = setting(doc="labels, e.g. [baseline, 125m]", check=WORDS, factory=list)
    notes: Any = setting(None, "a sentence on what this run tries", OPTIONAL_TEXT)
    job_type: Any = setting("train", "W&B's job type", OPTIONAL_TEXT)
    log_checkpoints: bool = setting(False, "every checkpoint also as a W&B artifact (type checkpoint, aliases step<N> and "
                                          "latest; large for big models)", BOOLEAN)


@dataclass
class LoggingConfig(Section):
    """`logging.*` (see the module docstring)."""

    PREFIX: ClassVar[str] = "logging"
    log_interval: int = setting(10, "steps between metric records (metrics.jsonl + W&B) and progress lines",
                                POSITIVE_INT)
    wandb: WandbConfig = setting(doc="the Weights & Biases run", factory=WandbConfig)
    peak_tflops: Any = setting(None, "per-device dense bf16 peak for MFU; null: looked up from the GPU name (none on "
                                     "CPU)", Check(lambda v: v is None or (is_number(v) and v > 0), "must be null or > 0"))
    curves: bool = setting(True, "at the end of the run, draw its curves (loss, validation loss, learning rate, "
                                 "tokens/s, gradient norm against tokens) into <run dir>/curves.png and print the path; "
                                 "python -m train.curves draws them any time (needs matplotlib: the `curves` extra)",
                           BOOLEAN)
    tensorboard: bool = setting(False, "also write every metrics record as TensorBoard events into <run "
                                       "dir>/tensorboard/ (torch.utils.tensorboard)", TENSORBOARD)
