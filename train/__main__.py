"""Entry point: `python -m train [hydra overrides]`, also under torchrun or the deepspeed launcher.

Examples:
  python -m train                                    # the toy on this machine's CPU
  python -m train model=gpt3-125m train.max_steps=5000 optim.lr=6e-4
  torchrun --nproc_per_node 8 -m train model=gpt3-1.3b
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from train.launch_info import is_rank_zero, launch_timestamp

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")
# Used by configs/config.yaml so that all ranks of one launch agree on the run directory and only
# rank 0 writes Hydra's record of the config (.hydra/).
OmegaConf.register_new_resolver("launch_stamp", launch_timestamp, replace=True)
OmegaConf.register_new_resolver("rank_zero_only", lambda value: value if is_rank_zero() else None, replace=True)


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    from train.engine import resolve_device
    from train.plan import preflight
    from train.validate import ConfigError, check, check_keys

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        check_keys(cfg, hydra_cfg.job.config_name, list(hydra_cfg.overrides.task))
        check(cfg, run_dir)
        if resolve_device(cfg.train.device).type == "cuda":
            preflight(cfg)  # stop before building anything if the planner predicts it cannot fit
    except ConfigError as err:
        _discard_if_empty(run_dir)
        print(f"gpt3d: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None

    from train.checkpoint import CheckpointError
    from train.data_sources import DataError
    from train.engine import shutdown_distributed
    from train.faults import NonFiniteError
    from train.loop import run

    try:
        run(cfg, run_dir)
        shutdown_distributed()
    # a bad record met mid-run with data.on_bad_record=error, a dead data worker; no usable checkpoint to resume
    except (DataError, CheckpointError) as err:
        print(f"gpt3d: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except NonFiniteError as err:  # too many skipped steps in a row, or non-finite weights: every rank alike
        if is_rank_zero():
            print(f"gpt3d: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None


def _discard_if_empty(run_dir: Path) -> None:
    """Remove a run directory that holds nothing but Hydra's own bookkeeping (a run that never started)."""
    if run_dir.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in run_dir.iterdir()):
        shutil.rmtree(run_dir)


def _drop_launcher_arguments(argv: list[str]) -> list[str]:
    """The deepspeed launcher appends --local_rank=N (also in LOCAL_RANK); Hydra takes only overrides."""
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


if __name__ == "__main__":
    sys.argv = _drop_launcher_arguments(sys.argv)
    main()
