"""Entry point: `python -m train [hydra overrides]`, also under torchrun or the deepspeed launcher.

Examples:
  python -m train                                    # the toy on this machine's CPU
  python -m train model=gpt3-125m train.max_steps=5000 optim.lr=6e-4
  torchrun --nproc_per_node 8 -m train model=gpt3-1.3b

The config is checked and resolved once (train/run/spec.py) before anything is built; a bad
value exits with EXIT_BAD_INPUT (2), a run that started and cannot go on with EXIT_FAILED (1), a
checkpoint the disk refused with EXIT_CANNOT_SAVE (4) and a data file (or Hub) that stayed unreadable with
EXIT_DATA_UNREADABLE (5), each with one line.
"""

from __future__ import annotations

import signal

# First, before the imports that take seconds: hold SIGUSR1 pending until the stop handlers are in place
# (StopSignals.install, train/guard/preemption.py), in this thread and every thread and child started
# meanwhile. It is a scheduler's warning that time is almost up (SLURM's --signal), it can come while
# the run still starts (imports, rendezvous, building, loading), and its default action would end the
# process with nothing saved. SIGTERM and SIGINT keep theirs: a launcher must be able to stop a hung start.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})

import shutil  # noqa: E402 (after the mask)
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from train.config.entry import (
    CONFIG_DIR,
    EXIT_BAD_INPUT,
    EXIT_CANNOT_SAVE,
    EXIT_DATA_UNREADABLE,
    EXIT_FAILED,
    drop_launcher_arguments,
    quiet_library_warnings,
    register_config,
)
from train.config.launch import is_rank_zero, launcher_stops_all_at_first_exit

REPORT_GRACE_S = 30  # the longest another rank waits for rank 0 to report bad input (see _refuse)


@hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    from train.config.settings import ConfigError
    from train.run.checks import RunFinished, check_keys
    from train.run.spec import resolve
    from train.runtime.device import order_cuda_queues

    par = cfg.parallel  # before anything initialises CUDA (train/runtime/device.py)
    order_cuda_queues(par.tp, par.layout, par.overlap_communication, cfg.train.device)
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        overrides = list(hydra_cfg.overrides.task)
        check_keys(cfg, hydra_cfg.job.config_name, overrides)
        spec = resolve(cfg, run_dir, overrides)  # on CUDA also pre-flight: stop before building what cannot fit
    except ConfigError as err:
        _discard_if_empty(run_dir)
        _refuse(err)
    except RunFinished as finished:  # nothing to train: no W&B segment, no sample
        _discard_if_empty(run_dir)
        if is_rank_zero():
            print(f"gpt3d: {finished}", flush=True)
        return

    if is_rank_zero():
        from train.run.run_folder import set_aside

        set_aside(spec.folder)  # train.resume=overwrite: the old run's files into <run dir>.replaced-<time>
    from train.checkpoint import CheckpointError, StorageError
    from train.data import DataError, DataUnavailable
    from train.guard.nonfinite import NonFiniteError
    from train.run.loop import run
    from train.runtime.process_group import shutdown_distributed

    try:
        run(spec)
        shutdown_distributed()
    except StorageError as err:  # a save the disk refused: every rank alike
        if is_rank_zero():
            print(f"gpt3d: error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_CANNOT_SAVE) from None
    except DataUnavailable as err:  # the rank whose file it is names it; rank 0 always speaks
        if err.path is not None or is_rank_zero():
            print(f"gpt3d: error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_DATA_UNREADABLE) from None
    # a bad record met mid-run with data.on_bad_record=error, a dead data worker; no usable checkpoint to resume
    except (DataError, CheckpointError) as err:
        if is_rank_zero():
            _discard_if_empty(run_dir)
        print(f"gpt3d: error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_FAILED) from None
    except NonFiniteError as err:  # too many skipped steps in a row, or non-finite weights: every rank alike
        if is_rank_zero():
            print(f"gpt3d: error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_FAILED) from None


def _refuse(err: Exception) -> None:
    """Bad input: one line on rank 0 (every rank finds the same), exit EXIT_BAD_INPUT on every rank.

    Under torchrun or DeepSpeed's launcher the other ranks exit only after REPORT_GRACE_S (or when the launcher
    stops them, once rank 0 has exited): those launchers stop every rank as soon as one fails, so a rank that
    ended first could get rank 0 stopped before its line was written. srun, as launch/slurm.sbatch runs it,
    lets each rank end by itself: no wait."""
    if is_rank_zero():
        print(f"gpt3d: error: {err}", file=sys.stderr, flush=True)
    elif launcher_stops_all_at_first_exit():
        time.sleep(REPORT_GRACE_S)
    raise SystemExit(EXIT_BAD_INPUT) from None


def _check_command_line(arguments: list[str]) -> None:
    """Overrides that name no setting or config, a run folder that cannot be made: refused before Hydra runs."""
    from train.config.command_line import check_command_line
    from train.config.settings import ConfigError

    try:
        check_command_line(arguments)
    except ConfigError as err:
        _refuse(err)


def _discard_if_empty(run_dir: Path) -> None:
    """Remove a run directory that holds nothing but Hydra's own bookkeeping (a run that never started)."""
    if run_dir.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in run_dir.iterdir()):
        shutil.rmtree(run_dir)


if __name__ == "__main__":
    sys.argv = drop_launcher_arguments(sys.argv)
    from train.config.usage import answer_help, train_help

    answer_help(sys.argv[1:], train_help)  # (--hydra-help still gives Hydra's own)
    register_config()
    _check_command_line(sys.argv[1:])
    quiet_library_warnings()
    main()
