"""`python -m train.generate`: text from a trained run, at any layout.

    python -m train.generate generate.checkpoint=runs/toy/2026-01-01_12-00-00 generate.prompt='import os'
    python -m train.generate generate.checkpoint=... generate.temperature=0 generate.max_new_tokens=32
    torchrun --nproc_per_node 4 -m train.generate parallel.tp=2 parallel.pp=2 generate.checkpoint=...

The config is the training one (model.* must be the run's; parallel.* is the layout to generate
at, whatever the run trained at; train.device, train.seed) plus the `generate` group
(configs/generate/default.yaml). The checkpoint's weights are put back together whole
(train/checkpoint/manager.py: read_model_weights) and each rank takes its slice (parallel.naming).
Rank 0 prints the text, and writes {prompt, tokens, text} as JSON to generate.output if set.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from model import GPTConfig
from train.config.entry import (
    CONFIG_DIR, EXIT_BAD_INPUT, drop_launcher_arguments, quiet_library_warnings, register_resolvers,
)
from train.metrics import write_atomically
from train.sample import sample_text
from train.weights import checkpoint_weights


def run(cfg, model_cfg: GPTConfig, folder: Path, weights: dict[str, torch.Tensor]) -> str:
    """Build this rank's part at cfg.parallel's layout, give it its slices of `weights`, generate."""
    from parallel.build import BuildOptions, build_model
    from parallel.naming import load_full_
    from parallel.topology import Topology
    from train.engine import init_distributed, resolve_device, shutdown_distributed
    from train.precision import resolve_precision

    device = resolve_device(cfg.train.device)
    init_distributed(device)
    topology = Topology.create(cfg.parallel.tp, cfg.parallel.pp)
    part = build_model(model_cfg, topology, cfg.train.seed, device, BuildOptions(cfg.parallel.sequence_parallel))
    load_full_(part, weights, model_cfg, topology)
    gen = cfg.generate
    bf16 = resolve_precision(cfg.train.precision, device) != "fp32"
    text, tokens = sample_text(part, model_cfg, topology, gen.prompt, gen.max_new_tokens, device, cfg.train.seed,
                               gen.temperature, gen.top_k, bf16)
    if topology.rank == 0 and gen.output is not None:
        record = {"checkpoint": str(folder), "prompt": gen.prompt, "tokens": tokens, "text": text}
        write_atomically(Path(gen.output), json.dumps(record) + "\n")
    shutdown_distributed()
    return text if topology.rank == 0 else ""


@hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="generate")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from train.config.checks import ConfigError, check_generation, check_keys

    try:
        check_keys(cfg, "generate", list(HydraConfig.get().overrides.task))
        model_cfg, folder = check_generation(cfg)
        weights = checkpoint_weights(folder, model_cfg)
    except ConfigError as err:
        print(f"gpt3d: error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None
    text = run(cfg, model_cfg, folder, weights)
    if text:
        print(text, flush=True)


if __name__ == "__main__":
    sys.argv = drop_launcher_arguments(sys.argv)
    register_resolvers()
    quiet_library_warnings()
    main()
