"""`python -m train.generate`: text from a trained run, at any layout.

    python -m train.generate generate.checkpoint=runs/toy/2026-01-01_12-00-00 generate.prompt='import os'
    python -m train.generate generate.checkpoint=... generate.temperature=0 generate.max_new_tokens=32
    torchrun --nproc_per_node 4 -m train.generate parallel.tp=2 parallel.pp=2 generate.checkpoint=...

The config is the training one (model.* is the checkpoint's, so it need not be given: a model key
on the command line may change how the model computes, e.g. model.attention_impl, never its shape;
parallel.* is the layout to generate at, whatever the run trained at; train.device, train.seed) plus
the `generate` group
(train/config/sections/generate.py; configs/generate/default.yaml). The checkpoint's weights are put
back together whole (train/checkpoint/loading.py: read_model_weights) and each rank takes its slice
(parallel.naming).
Rank 0 prints the text, and writes {prompt, tokens, text} as JSON to generate.output if set.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig

from train.config.entry import (
    CONFIG_DIR,
    EXIT_BAD_INPUT,
    drop_launcher_arguments,
    quiet_library_warnings,
    register_config,
)
from train.config.sections import GenerateConfig, Sections
from train.config.usage import Help, answer_help, section_settings

if TYPE_CHECKING:
    import torch

    from model import GPTConfig
    from train.runtime.resolve import Runtime


def command_help() -> Help:
    """What `python -m train.generate --help` says."""
    return Help(
        usage=("python -m train.generate generate.checkpoint=RUN [KEY=VALUE ...]",
               "torchrun --nproc_per_node N -m train.generate parallel.tp=T parallel.pp=P [...]"),
        purpose="Continues a prompt with a trained run's model, at any layout, and prints the text. The model is "
                "the checkpoint's own, so model.* need not be given; parallel.*, train.device and train.seed are "
                "training's.",
        settings_title="settings (KEY=VALUE)",
        settings=section_settings(GenerateConfig),
        examples=("python -m train.generate generate.checkpoint=runs/toy/2026-01-01_12-00-00 generate.prompt='Return the'",
                  "python -m train.generate generate.checkpoint=runs/toy/2026-01-01_12-00-00 generate.temperature=0 "
                  "generate.max_new_tokens=32"),
        more="sampling, the KV cache and layouts: docs/generation.md",
    )


def run(sections: Sections, runtime: Runtime, gen: GenerateConfig, model_cfg: GPTConfig, folder: Path,
        weights: dict[str, torch.Tensor]) -> str:
    """Build this rank's part at the parallel section's layout, give it its slices of `weights`, generate
    as the generate section (`gen`) says."""
    from train.checkpoint.model_part import model_part
    from train.evaluation.sample import sample_text
    from train.monitor.metrics import write_atomically
    from train.runtime.process_group import shutdown_distributed

    train, parallel = sections.train, sections.parallel
    part, topology = model_part(weights, model_cfg, parallel.tp, parallel.pp, runtime, train.seed,
                                parallel.sequence_parallel)
    text, tokens = sample_text(part, model_cfg, topology, gen.prompt, gen.max_new_tokens, runtime.device, train.seed,
                               gen.temperature, gen.top_k, runtime.bf16_products)
    if topology.rank == 0 and gen.output is not None:
        record = {"checkpoint": str(folder), "prompt": gen.prompt, "tokens": tokens, "text": text}
        write_atomically(Path(gen.output), json.dumps(record) + "\n")
    shutdown_distributed()
    return text if topology.rank == 0 else ""


@hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="generate")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from train.checkpoint.model_part import checkpoint_weights
    from train.config.settings import ConfigError
    from train.run.checks import check_generation, check_keys, check_runtime

    try:
        overrides = list(HydraConfig.get().overrides.task)
        check_keys(cfg, "generate", overrides)
        sections, gen = Sections.of(cfg), OmegaConf.to_object(cfg.generate)
        runtime = check_runtime(sections.train)
        keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
        model_given = [key for key in keys if key == "model" or key.startswith("model.")]
        model_cfg, folder = check_generation(gen, sections.parallel, OmegaConf.to_container(cfg.model, resolve=True),
                                             model_given)
        weights = checkpoint_weights(folder, model_cfg)
    except ConfigError as err:
        print(f"gpt3d: error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None
    text = run(sections, runtime, gen, model_cfg, folder, weights)
    if text:
        print(text, flush=True)


if __name__ == "__main__":
    sys.argv = drop_launcher_arguments(sys.argv)
    answer_help(sys.argv[1:], command_help)
    register_config()
    quiet_library_warnings()
    main()
