"""What every command's entry point needs before Hydra composes a config.

- CONFIG_DIR: the Hydra config folder (configs/ at the repository root), the one definition.
- register_config(): the typed schema every command's config is composed on (train/config/sections/:
  configs/config.yaml's defaults list starts with it), and the `${launch_stamp:}` and
  `${rank_zero_only:}` resolvers configs/config.yaml uses, so that all ranks of one launch agree on the
  run directory and only rank 0 writes Hydra's record of the config (.hydra/). Call it before composing
  (hydra.main or hydra.compose).
- drop_launcher_arguments(): the deepspeed launcher appends --local_rank=N; Hydra takes only overrides.
- quiet_library_warnings(): silences library warnings that tell the user nothing (call before importing them).
- Exit codes: EXIT_BAD_INPUT (2) for anything refused before the run starts, EXIT_FAILED (1) for a run
  that started and could not go on (a bad record under data.on_bad_record=error, no usable checkpoint,
  too many non-finite steps); the machine's faults: EXIT_CANNOT_SAVE (4), a checkpoint the file system
  refused (full, read-only), the earlier ones intact; EXIT_DATA_UNREADABLE (5), a data file that stayed
  unreadable, the run saved at the step it reached. A hang is 3 (train/guard/watchdog.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf

from train.config.launch import is_rank_zero, launch_timestamp

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_CANNOT_SAVE = 4
EXIT_DATA_UNREADABLE = 5


def register_config() -> None:
    """Register the schema and the resolvers configs/config.yaml uses (idempotent)."""
    from hydra.core.config_store import ConfigStore

    from train.config.sections import DATA_KINDS, SCHEMA_NAME, RunConfig

    store = ConfigStore.instance()
    store.store(name=SCHEMA_NAME, node=RunConfig)
    for kind, schema in DATA_KINDS.items():  # each configs/data/*.yaml starts from its kind's
        store.store(group="data", name=f"schema_{kind}", node=schema)
    OmegaConf.register_new_resolver("launch_stamp", launch_timestamp, replace=True)
    OmegaConf.register_new_resolver("rank_zero_only", lambda value: value if is_rank_zero() else None, replace=True)


def drop_launcher_arguments(argv: list[str]) -> list[str]:
    """argv without --local_rank=N / --local-rank N (the deepspeed launcher's; also in LOCAL_RANK)."""
    kept, skip_next = [], False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            continue
        elif arg in ("--local_rank", "--local-rank"):
            skip_next = True
        else:
            kept.append(arg)
    return kept


def quiet_library_warnings() -> None:
    """On a machine without a GPU DeepSpeed warns "Setting accelerator to CPU. If you have GPU ..." each time it
    is imported; naming its accelerator (DS_ACCELERATOR=cpu, DeepSpeed's own setting, unless the user set one)
    says the same thing to DeepSpeed without the warning. DeepSpeed's ZeRO optimizers call collectives that
    torch has renamed, and torch says so once per process, so once per rank: a note for DeepSpeed's
    authors, not for whoever runs gpt3d."""
    import warnings

    import torch

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                                              r"is deprecated", category=FutureWarning)
