"""The config's typed sections, one dataclass a section (train/config/settings.py), and the root that
holds them: the schema every command's config is composed on (train/config/entry.py registers it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig

from train.config.sections.data import KINDS as DATA_KINDS
from train.config.sections.data import DataConfig
from train.config.sections.evaluate import EvaluateConfig
from train.config.sections.generate import GenerateConfig
from train.config.sections.logging import LoggingConfig, WandbConfig
from train.config.sections.optim import OptimConfig
from train.config.sections.parallel import ParallelConfig
from train.config.sections.plan import DeviceFigures, PlanConfig
from train.config.sections.train import BatchRampConfig, TrainConfig
from train.config.settings import Section

SCHEMA_NAME = "gpt3d_schema"  # configs/config.yaml's defaults list starts with it


@dataclass
class RunConfig:
    """Every command's config. `model` is the model group's mapping, checked as model/config.py's
    GPTConfig; `deepspeed` is DeepSpeed's pass-through, checked against DeepSpeed's own settings;
    `plan` is there with `+plan=…` (python -m train.plan adds it), `generate` with python -m train.generate.
    `data` is typed by the schema its group file starts from, one per kind of source (`DATA_KINDS`)."""

    model: Any = None
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: Any = None  # the data group's file, on its kind's schema (train/config/sections/data.py)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    deepspeed: Any = field(default_factory=dict)
    plan: Optional[PlanConfig] = None
    generate: Optional[GenerateConfig] = None


@dataclass(frozen=True)
class Sections:
    """A composed run config as its typed sections, each built (and so checked) from the config; what
    each component receives. `replaced` gives another with some values changed, checked again."""

    train: TrainConfig
    optim: OptimConfig
    parallel: ParallelConfig
    data: DataConfig
    logging: LoggingConfig
    evaluate: EvaluateConfig
    deepspeed: dict  # DeepSpeed's pass-through (the deepspeed group), checked against DeepSpeed's settings

    @classmethod
    def of(cls, cfg: DictConfig) -> "Sections":
        """Each section of a composed config built, its checks run (ConfigError at the first bad value)."""
        from omegaconf import OmegaConf

        built = {name: _built(cfg, name) for name in ("train", "optim", "parallel", "data", "logging", "evaluate")}
        extras = OmegaConf.to_container(cfg.deepspeed, resolve=True) if cfg.get("deepspeed") else {}
        return cls(**built, deepspeed=extras)

    def replaced(self, values: dict) -> "Sections":
        """These sections with `values` ({dotted key: value}, e.g. {"train.micro_batch_size": 4}) in place."""
        sections = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key, value in values.items():
            name, _, rest = key.partition(".")
            sections[name] = _with(sections[name], rest, value)
        return Sections(**sections)

    def value(self, dotted: str):
        """The value at a dotted key, e.g. "train.batch_ramp.start"."""
        value = self
        for name in dotted.split("."):
            value = getattr(value, name)
        return value

    def record(self) -> dict:
        """The sections as plain data (W&B's config record, state.json's schedule record)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _built(cfg: DictConfig, name: str):
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    from train.config.settings import ConfigError

    try:
        return OmegaConf.to_object(cfg[name])
    except MissingMandatoryValue as err:
        raise ConfigError(f"{err.full_key} is not set (see docs/configuration.md)") from None


def _with(section: Section, dotted: str, value):
    """`section` with the field at `dotted` (a name, or nested.name) replaced; a new, checked object."""
    name, _, rest = dotted.partition(".")
    return dataclasses.replace(section, **{name: _with(getattr(section, name), rest, value) if rest else value})


def _plain(value):
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


# Each section of the key table (train/config/key_table.py), in the table's order.
SECTIONS = (TrainConfig, BatchRampConfig, OptimConfig, ParallelConfig, DataConfig, *DATA_KINDS.values(),
            LoggingConfig, WandbConfig, EvaluateConfig, GenerateConfig, PlanConfig, DeviceFigures)

__all__ = [
    "SCHEMA_NAME", "SECTIONS", "BatchRampConfig", "DataConfig", "DeviceFigures", "EvaluateConfig", "GenerateConfig",
    "LoggingConfig",
    "OptimConfig", "ParallelConfig", "PlanConfig", "RunConfig", "TrainConfig", "WandbConfig",
]
