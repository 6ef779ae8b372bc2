"""A run built from its specification: this rank's model in a DeepSpeed engine, its data and its
checkpoints, all in one `Trainer`.

`build(spec)` joins the process group on the run's device (spec.runtime), makes the pp × dp × tp
topology, builds this rank's part of the model in the modes the sections ask for (parallel.build),
starts it from a Hugging Face folder if train.init_from says so, wraps it with the optimizer and LR
schedule in DeepSpeed's engine (train/run/engine.py), opens its data stream and validation windows
(train/data/), and gives its checkpoints to one Checkpointer with the parts they hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from model import GPTConfig, count_parameters
from train import data
from train.checkpoint import (
    Checkpointer,
    CheckpointParts,
    CheckpointSettings,
    EngineCounters,
    KernelChoices,
    Keyed,
    ProcessRNG,
    Record,
    read_init_weights,
)
from train.config.sections import Sections
from train.config.sections.parallel import INTERLEAVED, ONE_F_ONE_B
from train.guard.peers import PeerWatch
from train.monitor import metrics, report
from train.monitor.metrics import full_shapes_model
from train.run import batch_ramp
from train.run import engine as engines
from train.run.optimizer import GIVEN_NORM, OWN_NORM, TokenLR, make_optimizer
from train.run.spec import RunSpec
from train.run.step import TrainStep
from train.runtime.process_group import init_distributed


@dataclass
class Progress:
    """Loop counters that survive a resume."""

    step: int = 0
    tokens: int = 0

    def advance(self, tokens: int) -> None:
        self.step += 1
        self.tokens += tokens

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens = state["step"], state["tokens"]


@dataclass
class Trainer:
    """Everything a built run holds: its specification, where it runs, this rank's engine and step,
    its data, and its checkpoints (train/checkpoint/checkpointer.py)."""

    spec: RunSpec
    topology: object
    engine: object
    step: TrainStep
    batches: data.TrainBatches
    val_batches: list[torch.Tensor]
    lr: TokenLR  # the learning rate by tokens seen
    progress: Progress
    checkpointer: Checkpointer

    @property
    def sections(self) -> Sections:  # the run's config sections (train/config/sections/), as resolved
        return self.spec.sections

    @property
    def device(self) -> torch.device:  # the run's device (spec.runtime: resolved once)
        return self.spec.runtime.device

    @property
    def run_dir(self) -> Path:
        return self.spec.run_dir

    @property
    def model_cfg(self) -> GPTConfig:
        return self.spec.model

    @property
    def ramp(self) -> batch_ramp.BatchRamp:  # global batch size (sequences) by tokens seen
        return self.spec.ramp

    @property
    def plan(self):  # the planner's prediction for this run (train/planner/), on CUDA
        return self.spec.plan

    def say(self, text: str) -> None:
        """A line of the run's output, printed by rank 0 (train/monitor/report.py)."""
        report.say(text, self.topology.rank == 0)


def build(spec: RunSpec) -> Trainer:
    """Device, process group, layout, this rank's model in a DeepSpeed engine, its data, and its
    checkpointer with the parts its checkpoints hold."""
    from model.float8_weights import WeightCasts
    from model.weight_grads import WeightGradStore
    from parallel.build import BuildOptions, build_model
    from parallel.topology import Topology
    from parallel.schedules.engine import ScheduleEngine
    from parallel.schedules.orders import ZB_V, Costs
    from train.planner.from_config import stage_split

    settings, model_cfg, ramp, runtime = spec.sections, spec.model, spec.ramp, spec.runtime
    device = runtime.device
    init_distributed(device, settings.train.collective_timeout_s)
    topology = Topology.create(settings.parallel.tp, settings.parallel.pp)
    PeerWatch.start(spec.run_dir, topology.rank, topology.world_size, settings.train.peer_timeout_s)

    torch.manual_seed(settings.train.seed)
    pipelined = topology.pp_size > 1
    par = settings.parallel
    schedule_name = par.pipeline_schedule if pipelined else ONE_F_ONE_B
    weight_grads = WeightGradStore() if par.defers_weight_grads else None  # filled by the linears, drained by the engine
    # the float8 layers' weight casts, kept through each step (model/float8_weights.py; TrainStep opens the step)
    fp8 = replace(runtime.fp8, weight_casts=WeightCasts()) if runtime.fp8 is not None else None
    split = stage_split(par)  # the schedule's virtual stages and parallel.stage_layers
    options = BuildOptions(
        sequence_parallel=settings.parallel.sequence_parallel,
        activation_checkpointing=settings.parallel.activation_checkpointing,
        overlap_communication=settings.parallel.overlap_communication,
        # (parallel.layout=auto: where the layout it chooses has sequence parallelism)
        tp_comm_overlap=settings.parallel.tp_comm_overlap and settings.parallel.sequence_parallel,
        fused_loss=settings.train.fused_loss,
        fp8=fp8,
        fp8_linears=frozenset(spec.fp8.linears) if spec.fp8 is not None else frozenset(),  # resolved once: spec.py
        weight_grads=weight_grads,
        stages=split,
    )
    model = build_model(model_cfg, topology, settings.train.seed, device, options)
    if settings.train.init_from is not None:  # a Hugging Face GPT-2 folder (train/checkpoint/hugging_face.py), sliced
        from parallel.naming import load_full_

        load_full_(model, read_init_weights(Path(settings.train.init_from), model_cfg), model_cfg, topology)
    # A PipelineModule brings its own grid (same topology) and DeepSpeed then wants no mpu of ours.
    mpu = model.mpu() if pipelined else topology.mpu
    schedule = spec.schedule.schedule  # a resume keeps its checkpoint's (train/run/schedule.py)
    clip = engines.clipping(settings.parallel, runtime)
    optimizer = make_optimizer(model, settings.optim, schedule.peak_lr, clip=clip, mpu=mpu)
    lr = TokenLR(optimizer, schedule, ramp.size_at(0) * model_cfg.seq_len)
    engine = engines.create_engine(
        model,
        optimizer,
        lr,
        engines.deepspeed_config(settings.train, settings.parallel, settings.optim, settings.deepspeed, topology.dp_size,
                                 runtime, spec.plan),
        mpu=None if pipelined else mpu,
    )
    if schedule_name != ONE_F_ONE_B:  # gpt3d's own schedules (parallel/schedules/); 1f1b is DeepSpeed's
        costs = spec.pass_costs if schedule_name == ZB_V else Costs()  # zb-h1's step is its equal-pass order's
        engine = ScheduleEngine.adopt(engine, schedule_name, par.virtual_stages, weight_grads, costs,
                                      reduce_chunks=par.overlap_communication)
    on_device = clip == OWN_NORM  # the step's skip decided on the device, and reported so (train/run/step.py)
    if clip == GIVEN_NORM:  # the optimizer DeepSpeed wraps ours in computes the norm
        on_device = engines.take_norm(optimizer, engine)
    # Ranks of one data-parallel replica (its tp and pp ranks) read the same windows.
    train, dp = settings.train, (topology.dp_rank, topology.dp_size)
    speaks = topology.tp_rank == 0 and topology.pp_rank == 0  # one warning per data-parallel replica
    batches = data.TrainBatches(spec.data, model_cfg.seq_len, train.global_batch_size, *dp, train.seed, warn=speaks)
    val_batches = []
    if train.eval_interval > 0 and train.eval_batches > 0:
        val_batches = data.validation_batches(spec.data, model_cfg.seq_len, train.global_batch_size, train.eval_batches, *dp)
    step = TrainStep(engine, train.micro_batch_size, device, autocast=runtime.autocast,
                     skips_on_device=optimizer if on_device else None,
                     weight_casts=fp8.weight_casts if fp8 is not None else None)
    progress = Progress()
    checkpointer = Checkpointer(CheckpointSettings.from_config(train, spec.run_dir, device, spec.resume),
                                checkpoint_parts(progress, batches, lr, engine, spec.schedule.state),
                                engine, topology, model_cfg, device)
    trainer = Trainer(spec, topology, engine, step, batches, val_batches, lr, progress, checkpointer)
    if spec.plan is not None and topology.rank == 0:
        metrics.write_atomically(spec.run_dir / "plan.json", json.dumps(spec.plan.to_json(), indent=2) + "\n")
    return trainer


def header(spec: RunSpec) -> str:
    """The run's first line, from its specification alone (printed before anything is built): the model and its
    size, the processes and layout, the data, the tokens per step and the run folder."""
    par = spec.sections.parallel
    return (f"model {spec.model.name}: {count_parameters(full_shapes_model(spec.model)) / 1e6:.2f}M parameters | "
            f"{par.tp * par.pp * spec.dp} process(es) on {spec.runtime.device} (tp={par.tp} pp={par.pp} dp={spec.dp} "
            f"zero={par.zero_stage}{_schedule_words(par)}) | data {spec.data.summary()} | "
            f"{_batch_line(spec.ramp)} | run dir {spec.run_dir}")


def _schedule_words(par) -> str:
    """The pipeline schedule as the header names it: nothing for DeepSpeed's 1f1b (or no pipeline)."""
    if par.pp == 1 or par.pipeline_schedule == ONE_F_ONE_B:
        return ""
    chunks = f" V={par.virtual_stages}" if par.pipeline_schedule == INTERLEAVED else ""
    return f" {par.pipeline_schedule}{chunks}"


def checkpoint_parts(progress: Progress, batches: data.TrainBatches, lr: TokenLR, engine, schedule: dict
                     ) -> CheckpointParts:
    """What a checkpoint of this run holds besides the tensors, each part registered once (`schedule`: the
    record of the schedule, read back by the config checks before a resumed run is built)."""
    parts = CheckpointParts()
    parts.add("progress", progress)
    parts.add("data", Keyed("data", batches))
    parts.add("lr schedule", Keyed("lr_scheduler", lr))
    parts.add("engine counters", EngineCounters(engine))
    parts.add("schedule record", Record({"extra": {"schedule": schedule}}))
    parts.add("rng", ProcessRNG(), per_rank=True)
    parts.add("kernel choices", KernelChoices(), per_rank=True)
    return parts


def _batch_line(ramp: batch_ramp.BatchRamp) -> str:
    tokens = ramp.full * ramp.seq_len
    if not ramp.enabled:
        return f"{tokens} tokens/step"
    return (f"batch ramp {ramp.start} → {ramp.full} sequences by {ramp.increment} over {ramp.ramp_tokens:,} tokens, "
            f"then {tokens} tokens/step")
