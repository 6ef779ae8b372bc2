"""A trained model at any layout, from a checkpoint: what the commands that run one (generate, evaluate,
the lm-eval model) build, each the same way.

`checkpoint_weights` reads the whole model's weights once (refused when the checkpoint holds another
model than model.* describes); `model_part` joins the process group, builds this rank's part of the
model at the layout (tp, pp; dp is what the world size leaves) on the runtime's device, and gives it
its slices of those weights (parallel.naming).
"""

from __future__ import annotations

from pathlib import Path

import torch

from model import GPTConfig
from train.checkpoint.integrity import check_model
from train.checkpoint.loading import read_model_weights, saved_model_config
from train.config.settings import ConfigError
from train.runtime.process_group import init_distributed
from train.runtime.resolve import Runtime


def checkpoint_weights(folder: Path, model_cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The whole model's weights from a checkpoint folder, refused (ConfigError) when the checkpoint
    is of another model than model.* describes."""
    try:
        check_model(saved_model_config(folder) or {}, model_cfg, folder)
        return read_model_weights(folder, model_cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def model_part(weights: dict[str, torch.Tensor], model_cfg: GPTConfig, tp: int, pp: int, runtime: Runtime, seed: int,
               sequence_parallel: bool = False):
    """(this rank's part of the model holding its slices of `weights`, the topology) at tensor-parallel size
    `tp` and pipeline size `pp`, on `runtime.device`, in the launcher's process group (joined here)."""
    from parallel.build import BuildOptions, build_model
    from parallel.naming import load_full_
    from parallel.topology import Topology

    init_distributed(runtime.device)
    topology = Topology.create(tp, pp)
    part = build_model(model_cfg, topology, seed, runtime.device, BuildOptions(sequence_parallel))
    load_full_(part, weights, model_cfg, topology)
    return part, topology
