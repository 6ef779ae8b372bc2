"""The run specification: the Hydra config checked and resolved once, before anything is built.

`resolve(cfg, run_dir)` takes these steps, each a check that raises one ConfigError:

  1. sections   the composed config as typed sections (train/config/sections/), each field checked;
                the runtime: the device on this machine and the precision on it, resolved once
                (train/runtime/resolve.py), which the build, the loop and the planner read from here
  2. model      model.* as a GPTConfig
  3. resume     the checkpoint train.resume names (with its state.json, read once), or None; the run
                folder, checked to be usable and not another run's (train/run/run_folder.py); a
                checkpoint already at train.max_steps ends here (checks.RunFinished); a Hugging Face
                start (train.init_from) of this model's shape
  4. schedule   a resume that keeps its checkpoint's schedule takes back its batch settings (global
                batch, ramp), with one note saying so, printed once every check below has passed
  5. layout     parallel.layout=auto: the layout train/planner/elastic.py chooses for WORLD_SIZE on this
                device, in place of the keys it sets; then the layout against the model and the
                world size, giving dp, and the batch against dp
     fp8        under train.precision=fp8, which block linears compute in float8: the rule of
                train/planner/fp8_rule.py at this layout's product shapes on this GPU (or as
                train.fp8_linears says), resolved here once for the build, the run's first lines, W&B's
                config and the plan; and model.compile as fp8 takes it: the blocks compiled wherever that
                can work (train.runtime.precision.fp8_compile), with the words saying how they run
  6. data       the corpus probed (train/data/probe.py); data.streams, when the user left it at its
                default and the corpus has too few documents for it, the smaller value the probe gives;
                the validation split sized to train.eval_batches (a small corpus: its tail, at most 10%
                of it, and train.eval_batches lowered to the batches that fit, with one note); a resume's
                checkpoint must have trained on the same data in the same order
  7. ramp, LR   the batch ramp against the model, dp and streams; the LR schedule of the run (a warmup
                the user set is used as given, the default one fits a short run: train/run/optimizer.py)
  8. tasks      train.eval_tasks read and made into requests, as evaluate.* says (train/evaluation/)
  9. plan       on CUDA the planner's prediction, which must fit the device (pre-flight)

Each step that changes a value makes new sections (`Sections.replaced`, checked again): the composed
config is never written. The build and the loop read only a RunSpec, and each component receives its
own section of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from model import GPTConfig
from train.checkpoint.resume_point import ResumePoint
from train.config.launch import is_rank_zero
from train.config.sections import Sections
from train.config.sections.parallel import AUTO
from train.config.settings import ConfigError
from train.data.sources import DataSpec
from train.run import checks
from train.run.batch_ramp import BatchRamp
from train.run.run_folder import RunFolder, check_run_folder
from train.run.schedule import RunSchedule, kept_schedule, recorded_schedule, schedule_for_run
from train.runtime.resolve import Runtime


@dataclass(frozen=True)
class RunSpec:
    """What a run follows (see the module docstring)."""

    sections: Sections  # the settings the run follows, as resolved: read, never written
    runtime: Runtime  # the device and the precision on it, resolved once
    run_dir: Path
    model: GPTConfig
    dp: int
    resume: ResumePoint | None
    folder: RunFolder
    ramp: BatchRamp
    schedule: RunSchedule
    plan: object | None  # train/planner/estimate.py's Plan, on CUDA
    data: DataSpec  # the data as the probe resolved it: its streams, its validation split cut (train/data/probe.py)
    layout: object | None = None  # train/planner/elastic.py's LayoutChoice, with parallel.layout=auto
    eval_tasks: tuple = ()  # train.eval_tasks, prepared (train/evaluation/suite.py: PreparedTask)
    fp8: object | None = None  # train/planner/fp8_rule.py's Fp8Choice under train.precision=fp8: which linears
    fp8_blocks: str = ""  # under fp8: how the blocks run, compiled or eager and why

    @property
    def fp8_line(self) -> str | None:
        """Under fp8, the run's line saying which linears compute in float8 and how the blocks run."""
        return None if self.fp8 is None else f"{self.fp8.line()}; {self.fp8_blocks}"

    @property
    def pass_costs(self):
        """The costs zb-v orders its passes by (parallel/schedules/orders.py: list_orders): on CUDA the plan's F, B
        and W of its slowest rank, as shares of its micro batch to two digits (the order the planner timed);
        elsewhere equal passes. (zb-h1 orders by equal passes: its closed form is that order's step.)"""
        from parallel.schedules.orders import Costs

        if self.plan is None:
            return Costs()
        return Costs(*self.plan.pipeline.passes.shares())

    @property
    def run_tokens(self) -> int:
        """Tokens trained on by train.max_steps."""
        return self.ramp.tokens_after(self.sections.train.max_steps)


def resolve(cfg: DictConfig, run_dir: Path, overrides: tuple[str, ...] | list[str] = ()) -> RunSpec:
    """Check the whole run config for a run in `run_dir` and resolve it (see the module docstring);
    `overrides` are the command line's, which say what the user set explicitly. Raises ConfigError."""
    run_dir, set_keys = Path(run_dir), [o.lstrip("+").split("=", 1)[0] for o in overrides]
    sections = Sections.of(cfg)
    runtime = checks.check_runtime(sections.train)
    model_cfg = checks.check_model(OmegaConf.to_container(cfg.model, resolve=True))
    resume = checks.check_resume(sections.train, run_dir, model_cfg)
    folder = check_run_folder(run_dir, sections.train.resume, resume.path if resume is not None else None)
    checks.check_unfinished(sections.train, resume)
    checks.check_init_from(sections.train, model_cfg)
    saved_schedule = recorded_schedule(resume.state if resume is not None else None)
    kept = kept_schedule(saved_schedule, sections)
    sections = sections.replaced(kept.batch)
    layout = _auto_layout(sections, model_cfg, set_keys, runtime)
    if layout is not None:
        sections = sections.replaced(layout.values())
    dp = checks.check_parallel(sections.parallel, model_cfg, sections.deepspeed)
    checks.check_batches(sections.train, dp, sections.parallel)
    model_cfg, fp8, fp8_blocks = _fp8(sections, model_cfg, runtime, set_keys)
    if (sections.parallel.tp_comm_overlap and sections.parallel.tp > 1 and fp8 is not None and fp8.linears
            and sections.train.fp8_recipe != "tensorwise"):
        raise ConfigError(f"parallel.tp_comm_overlap=true with train.fp8_recipe={sections.train.fp8_recipe}: the ring "
                          "sends each operand quantized once, with one scale for both of its products, which only "
                          "train.fp8_recipe=tensorwise has; use tensorwise, or tp_comm_overlap=false")
    data = checks.check_data(sections.data, sections.train, model_cfg.seq_len, dp,
                             streams_set="data.streams" in set_keys)
    sections = sections.replaced({"data.streams": data.streams})
    checks.check_resume_data(resume, data, model_cfg.seq_len, sections.train.seed)
    if sections.train.eval_batches > data.val_batches > 0:  # what at most 10% of a small corpus holds
        sections = sections.replaced({"train.eval_batches": data.val_batches})
    ramp = checks.check_batch_ramp(sections.train, model_cfg, dp, data.streams,
                                   checks.micro_batch_groups(sections.parallel))
    try:
        run_tokens = ramp.tokens_after(sections.train.max_steps)
        schedule = schedule_for_run(sections, model_cfg.name, run_tokens, kept, saved_schedule,
                                    warmup_set="optim.warmup_tokens" in set_keys)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    tasks = _eval_tasks(sections, model_cfg)
    plan = _plan(sections, model_cfg, runtime, fp8)
    if kept.note and is_rank_zero():  # once every check has passed: a refused resume keeps no schedule
        print(f"gpt3d: note: {kept.note}", flush=True)
    return RunSpec(sections, runtime, run_dir, model_cfg, dp, resume, folder, ramp, schedule, plan, data, layout,
                   tasks, fp8, fp8_blocks)


def _fp8(sections: Sections, model_cfg: GPTConfig, runtime: Runtime, set_keys: list[str]):
    """(the model config with model.compile as the run takes it, the fp8 choice or None, how the blocks run):
    under train.precision=fp8 the choice of train/planner/fp8_rule.py for this layout's tensor-parallel degree
    and micro batch, on this GPU's measured table (none on the CPU), and the blocks compiled where they can be
    (train.runtime.precision.fp8_compile). Other precisions: all as given."""
    from dataclasses import replace

    from train.runtime.precision import fp8_compile

    par, train = sections.parallel, sections.train
    if runtime.fp8 is None:
        return model_cfg, None, ""
    compiled, blocks = fp8_compile(runtime.precision, model_cfg.compile, "model.compile" in set_keys, runtime.device)
    from train.planner.fp8_rule import choice_for

    preset = None
    if runtime.device.type == "cuda":
        from train.planner.hardware import preset_for_cuda_device

        preset = preset_for_cuda_device(int(os.environ.get("LOCAL_RANK", 0)))
    try:
        choice = choice_for(model_cfg, par.tp, train.micro_batch_size, train.fp8_recipe, train.fp8_linears, preset)
    except ValueError as err:  # a measured table that cannot be read
        raise ConfigError(str(err)) from None
    return replace(model_cfg, compile=compiled), choice, blocks


def _eval_tasks(sections: Sections, model_cfg: GPTConfig) -> tuple:
    """train.eval_tasks prepared with evaluate.*'s files, shots, seed and limit (no task: nothing read)."""
    if not sections.train.eval_tasks:
        return ()
    from dataclasses import replace

    from train.evaluation import TaskError, prepare_tasks

    try:
        return tuple(prepare_tasks(replace(sections.evaluate, tasks=list(sections.train.eval_tasks)), model_cfg.seq_len))
    except TaskError as err:
        raise ConfigError(f"train.eval_tasks: {err}") from None


def _auto_layout(sections: Sections, model_cfg: GPTConfig, set_keys: list[str], runtime: Runtime):
    """With parallel.layout=auto: the layout train/planner/elastic.py chooses for this launch's world size and
    device, for the global batch and data order the run keeps (one line on rank 0 says which and why);
    None with manual. Every rank computes the same choice from the same inputs."""
    from train.planner.elastic import DataOrder, choose_layout

    if checks.check_layout_mode(sections.parallel, set_keys) != AUTO:
        return None
    from train.data.sources import resolve as resolve_data
    from train.run.batch_ramp import from_config

    train = sections.train
    processes = checks.world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", min(processes, 8)))
    try:
        ramp = from_config(train, model_cfg.seq_len)
        order = DataOrder(resolve_data(sections.data).streams, (ramp.start, ramp.increment) if ramp.enabled else None)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    hardware = None
    if runtime.device.type == "cuda":
        from train.planner.hardware import for_cuda_device

        hardware = for_cuda_device(int(os.environ.get("LOCAL_RANK", 0)))
    choice = choose_layout(model_cfg, processes, train.global_batch_size, order, hardware, per_node)
    if is_rank_zero():
        print(f"gpt3d: {choice.line()}", flush=True)
    return choice


def _plan(sections: Sections, model_cfg: GPTConfig, runtime: Runtime, fp8):
    """On CUDA: the planner's prediction for this run (its float8 linears the run's choice `fp8`), which must fit
    the device (pre-flight)."""
    if runtime.device.type != "cuda":
        return None
    from train.planner.from_config import plan_for_run, preflight

    try:
        plan = plan_for_run(sections.train, sections.parallel, model_cfg,
                            fp8_linears=fp8.linears if fp8 is not None else None, deepspeed=sections.deepspeed)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    preflight(plan)
    return plan
