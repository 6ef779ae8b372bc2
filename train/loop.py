"""What one run does: build, resume, then step, log, evaluate and checkpoint until max_steps, finish.

One optimizer step = one global batch of `train.global_batch_size` windows, or, under a batch-size
ramp (`train.batch_ramp`, train/batch_ramp.py), of the ramp's size at the tokens seen so far. This
rank takes its data-parallel slice (global / dp windows) and runs it as micro batches of
`train.micro_batch_size` (train/step.py); DeepSpeed accumulates and steps at the boundary. The
learning rate follows the tokens seen (train/optimizer.py: TokenLR).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from model import GPTConfig, count_parameters
from train import batch_ramp, checkpoint, data, engine as engines, metrics
from train.checkpoint.manager import print_warning
from train.checkpoint.parts import CheckpointParts
from train.checkpoint.resume_checks import RunSchedule
from train.checkpoint.rng import rng_state, set_rng_state
from train.checkpoint.writer import CheckpointWriter, is_async, remove_leftovers
from train.config.spec import RunSpec
from train.guard.safeguards import Safeguards
from train.metrics import Meter, full_shapes_model, mean_over_ranks
from train.optimizer import GIVEN_NORM, TokenLR, make_optimizer
from train.precision import fp8_mode, resolve_precision
from train.step import TrainStep


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
    its data, and the parts its checkpoints save and load (train/checkpoint/parts.py)."""

    spec: RunSpec
    device: torch.device
    topology: object
    engine: object
    step: TrainStep
    batches: data.TrainBatches
    val_batches: list[torch.Tensor]
    lr: TokenLR  # the learning rate by tokens seen
    progress: Progress
    parts: CheckpointParts

    @property
    def cfg(self):
        return self.spec.cfg

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
    def plan(self):  # the planner's prediction for this run (train/plan/), on CUDA
        return self.spec.plan

    @property
    def schedule(self) -> RunSchedule:  # the LR schedule, and what checkpoints record of it
        return self.spec.schedule


def run(spec: RunSpec) -> Progress:
    """Train per `spec` (train/config/spec.py: resolve); returns the final step and token count."""
    trainer = build(spec)
    resumed_from = resume(trainer)
    if trainer.topology.rank == 0:
        for name in remove_leftovers(spec.run_dir):
            _say(trainer, f"removed checkpoints/{name}: a save that was interrupted")
    train = spec.cfg.train
    writer = CheckpointWriter(is_async(train.async_checkpoint, trainer.device), train.keep_checkpoints, train.keep_every)
    progress = trainer.progress
    # rows after the step this run starts from (0: none) are from a run killed before its next checkpoint
    logger = open_logger(trainer, progress.step)
    meter = Meter(trainer.device, trainer.topology.world_size, spec.model, metrics.peak_tflops(trainer.device, spec.cfg.logging.peak_tflops),
                  trainer.batches, spec.plan, spec.run_tokens)
    guard = Safeguards(spec.cfg, spec.run_dir, trainer.engine, trainer.topology.rank, lambda text: _say(trainer, text),
                       resumed_from)
    try:
        stopped = loop(trainer, progress, logger, meter, guard, writer)
    except BaseException as err:
        if isinstance(err, Exception):  # not on a second Ctrl-C
            _finish_write_after_error(writer)
        trainer.batches.close()
        logger.close()
        raise
    finally:
        guard.close()
    finish(trainer, logger, sample=not stopped)
    return progress


def loop(trainer: Trainer, progress: Progress, logger: metrics.MetricsLogger, meter: Meter, guard: Safeguards,
         writer: CheckpointWriter) -> bool:
    """Step, log (+ evaluate), checkpoint until train.max_steps; True when a signal stopped it early.

    A step's metrics record is logged before its checkpoint is saved, so a checkpoint never holds a
    step whose record a kill could lose; a record carries the checkpoint times of the saves before it
    (train/checkpoint/writer.py), and the last step's record, logged after the final save and its
    write, that save's too. A save in the background is announced at the first step boundary after
    its write ended, and the last step's, and a stop's, are waited for.

    Faults (train/guard/safeguards.py): a step skipped for a non-finite loss or gradient is counted, and too
    many in a row raise NonFiniteError; SIGTERM / SIGINT / SIGUSR1 on any rank end the loop on every
    rank after the step with a checkpoint; a step that hangs ends the process from the watchdog's thread."""
    cfg, last = trainer.cfg, trainer.cfg.train.max_steps
    while progress.step < last:
        guard.step_begins(progress.step + 1)
        windows, size = next_batch(trainer, progress)
        result = trainer.step(windows)
        progress.advance(size * trainer.model_cfg.seq_len)
        meter.add(result.loss, size, result.skipped)
        guard.after_step(progress.step, result)  # a skipped step: say so
        record = None
        if _due(progress.step, cfg.logging.log_interval, last):
            record = meter.take(progress, result, guard.skips.total)
            if trainer.val_batches and _due(progress.step, cfg.train.eval_interval, last):
                guard.phase(f"evaluation after step {progress.step}")
                record["val/loss"] = evaluate(trainer)
            _say(trainer, _progress_line(record, last, meter.eta_s))
            meter.restart()
        saved = _due(progress.step, cfg.train.checkpoint_interval, last)
        if record is not None and progress.step < last:
            # before the save: a checkpoint is never published ahead of the records of the steps it holds
            logger.log({**record, **writer.times()})
            record = None
        try:
            guard.check_skips(progress.step, trainer.device)  # too many skipped in a row: NonFiniteError
            with meter.paused():  # saving time is not training throughput
                if saved:
                    save_checkpoint(trainer, guard, writer)
                    if progress.step == last:
                        writer.wait()  # the run ends: its last record holds this write's time
                announce_checkpoints(trainer, guard, logger, writer)
        finally:  # also when the run stops with an error here: the step's record is logged
            if record is not None:
                logger.log({**record, **writer.times()})
        verdict = guard.agree(progress.step, result)  # the step's one collective: a stop signal on any rank?
        if verdict.signal:
            if not saved:
                save_checkpoint(trainer, guard, writer)
            writer.wait()
            announce_checkpoints(trainer, guard, logger, writer)
            guard.stopped(progress.step, verdict, guard.last_checkpoint, finished=progress.step == last)
            return progress.step < last
    return False


def build(spec: RunSpec) -> Trainer:
    """Device, process group, layout, this rank's model in a DeepSpeed engine, its data, and the parts
    its checkpoints hold."""
    from parallel.build import BuildOptions, build_model
    from parallel.topology import Topology

    cfg, model_cfg, ramp = spec.cfg, spec.model, spec.ramp
    device = engines.resolve_device(cfg.train.device)
    engines.init_distributed(device, cfg.train.collective_timeout_s)
    topology = Topology.create(cfg.parallel.tp, cfg.parallel.pp)

    torch.manual_seed(cfg.train.seed)
    options = BuildOptions(
        sequence_parallel=cfg.parallel.sequence_parallel,
        activation_checkpointing=cfg.parallel.activation_checkpointing,
        overlap_communication=cfg.parallel.overlap_communication,
        fused_loss=cfg.train.fused_loss,
        fp8=fp8_mode(resolve_precision(cfg.train.precision, device), cfg.train.fp8_recipe, device),
    )
    model = build_model(model_cfg, topology, cfg.train.seed, device, options)
    if cfg.train.init_from is not None:  # a Hugging Face GPT-2 folder (train/checkpoint/hugging_face.py): its weights, sliced
        from parallel.naming import load_full_
        from train.checkpoint.hugging_face import read_init_weights

        load_full_(model, read_init_weights(Path(cfg.train.init_from), model_cfg), model_cfg, topology)
    pipelined = topology.pp_size > 1
    # A PipelineModule brings its own grid (same topology) and DeepSpeed then wants no mpu of ours.
    mpu = model.mpu() if pipelined else topology.mpu
    schedule = spec.schedule.schedule  # a resume keeps its checkpoint's (train/checkpoint/resume_checks.py)
    clip = engines.clipping(cfg, device)
    optimizer = make_optimizer(model, cfg.optim, schedule.peak_lr, clip=clip, mpu=mpu)
    lr = TokenLR(optimizer, schedule, ramp.size_at(0) * model_cfg.seq_len)
    engine = engines.create_engine(
        model,
        optimizer,
        lr,
        engines.deepspeed_config(cfg, topology.dp_size, device, spec.plan),
        mpu=None if pipelined else mpu,
    )
    if clip == GIVEN_NORM:
        optimizer.take_norm_from(engine.optimizer)  # DeepSpeed's bf16 optimizer, which computes the norm
    # Ranks of one data-parallel replica (its tp and pp ranks) read the same windows.
    train, dp = cfg.train, (topology.dp_rank, topology.dp_size)
    speaks = topology.tp_rank == 0 and topology.pp_rank == 0  # one warning per data-parallel replica
    batches = data.TrainBatches(cfg.data, model_cfg.seq_len, train.global_batch_size, *dp, train.seed, warn=speaks)
    val_batches = []
    if train.eval_interval > 0 and train.eval_batches > 0:
        val_batches = data.validation_batches(cfg.data, model_cfg.seq_len, train.global_batch_size, train.eval_batches, *dp)
    step = TrainStep(engine, train.micro_batch_size, device,
                     autocast=resolve_precision(train.precision, device) == "autocast")
    progress = Progress()
    trainer = Trainer(spec, device, topology, engine, step, batches, val_batches, lr, progress,
                      checkpoint_parts(progress, batches, lr, engine, spec.schedule))
    if spec.plan is not None and topology.rank == 0:
        metrics.write_atomically(spec.run_dir / "plan.json", json.dumps(spec.plan.to_json(), indent=2) + "\n")
    _say(
        trainer,
        f"model {model_cfg.name}: {count_parameters(full_shapes_model(model_cfg)) / 1e6:.2f}M parameters | "
        f"{topology.world_size} process(es) on {device} (tp={topology.tp_size} pp={topology.pp_size} "
        f"dp={topology.dp_size} zero={cfg.parallel.zero_stage}) | {_batch_line(ramp)} | run dir {spec.run_dir}",
    )
    return trainer


def checkpoint_parts(progress: Progress, batches: data.TrainBatches, lr: TokenLR, engine, schedule: RunSchedule
                     ) -> CheckpointParts:
    """What a checkpoint of this run holds besides the tensors, each part registered once."""
    parts = CheckpointParts()
    parts.add("progress", progress.state_dict, progress.load_state_dict)
    parts.add("data", lambda: {"data": batches.state_dict()}, lambda state: batches.load_state_dict(state["data"]))
    parts.add("lr schedule", lambda: {"lr_scheduler": lr.state_dict()}, lambda state: lr.load_state_dict(state["lr_scheduler"]))
    parts.add("engine counters", lambda: engines.counters(engine), lambda state: engines.restore_counters(engine, state))
    parts.add("schedule record", lambda: {"extra": {"schedule": schedule.state}}, None)  # read back by the config checks
    parts.add("rng", rng_state, set_rng_state, per_rank=True)
    return parts


def _batch_line(ramp: batch_ramp.BatchRamp) -> str:
    tokens = ramp.full * ramp.seq_len
    if not ramp.enabled:
        return f"{tokens} tokens/step"
    return (f"batch ramp {ramp.start} → {ramp.full} sequences by {ramp.increment} over {ramp.ramp_tokens:,} tokens, "
            f"then {tokens} tokens/step")


def resume(trainer: Trainer) -> Path | None:
    """Load the checkpoint the run specification names, if any, at this run's layout (whatever layout
    saved it): weights, optimizer, and every registered part; returns the step folder loaded or None."""
    point = trainer.spec.resume
    if point is None:
        return None
    folder, state = checkpoint.load(trainer.engine, trainer.topology, trainer.model_cfg, point.path, trainer.parts,
                                    known=(point.folder, point.state))
    trainer.batches.start()  # background workers (data.workers) begin packing from the restored position
    saved, now = state["layout"], checkpoint.layout_of(trainer.engine, trainer.topology)
    moved = "" if saved == now else f" (saved at {_layout_text(saved)}, now {_layout_text(now)})"
    _say(trainer, f"resumed from {folder} at step {trainer.progress.step}{moved}")
    return folder


def _layout_text(layout: dict) -> str:
    offload = " offload" if layout["offload_optimizer"] else ""
    return f"tp={layout['tp']} pp={layout['pp']} dp={layout['dp']} zero={layout['zero_stage']}{offload}"


def next_batch(trainer: Trainer, progress: Progress) -> tuple[torch.Tensor, int]:
    """This rank's windows of the next global batch and that batch's size in sequences: the ramp's
    size at the tokens consumed so far (train.batch_ramp; else train.global_batch_size). The learning
    rate is set for the tokens trained on once this batch is (TokenLR.next_step)."""
    size = trainer.ramp.size_at(progress.tokens)
    trainer.lr.next_step(size * trainer.model_cfg.seq_len)
    return trainer.batches.next_batch(size), size


def open_logger(trainer: Trainer, resumed_step: int | None) -> metrics.MetricsLogger:
    """metrics.jsonl and W&B, on rank 0 only; records after `resumed_step` are dropped (see MetricsLogger).
    W&B gets the resolved config (metrics.run_record) and, by default, a name saying model and layout; the first
    record of each start holds its layout (layout/*), with parallel.layout=auto also why it was chosen."""
    topo, spec = trainer.topology, trainer.spec
    layout = {"tp": topo.tp_size, "pp": topo.pp_size, "dp": topo.dp_size, "zero_stage": trainer.cfg.parallel.zero_stage,
              "micro_batch": trainer.cfg.train.micro_batch_size,
              "activation_checkpointing": trainer.cfg.parallel.activation_checkpointing}
    first = {f"layout/{key}": value for key, value in layout.items()}
    if spec.layout is not None:  # parallel.layout=auto: what it chose and why
        layout["auto"], first["layout/auto"] = spec.layout.to_json(), spec.layout.line()
    run_config = metrics.run_record(OmegaConf.to_container(trainer.cfg, resolve=True), spec.schedule.schedule, layout,
                                    trainer.ramp.full, spec.model.seq_len, trainer.plan)
    name = f"{spec.model.name}-tp{topo.tp_size}pp{topo.pp_size}dp{topo.dp_size}-{trainer.run_dir.name}"
    return metrics.MetricsLogger(trainer.run_dir, trainer.cfg.logging, run_config, active=topo.rank == 0,
                                 resumed_step=resumed_step, resumed=spec.resume is not None, default_name=name,
                                 first_record=first)


def evaluate(trainer: Trainer) -> float:
    """Mean next-token loss over the held-out windows, averaged over all ranks."""
    return mean_over_ranks(_mean(trainer.step.evaluate(trainer.val_batches)))


def save_checkpoint(trainer: Trainer, guard: Safeguards, writer: CheckpointWriter) -> None:
    """A checkpoint of the run as it stands (train/checkpoint/), then retention, written here or in the
    background (`writer`); never one of non-finite weights (NonFiniteError instead)."""
    stopped_at = time.perf_counter()
    step = trainer.progress.step
    guard.phase(f"checkpoint at step {step}")
    guard.before_saving(step, trainer.device)
    writer.save(trainer.engine, trainer.topology, trainer.model_cfg, trainer.run_dir, trainer.parts, stopped_at)


def announce_checkpoints(trainer: Trainer, guard: Safeguards, logger: metrics.MetricsLogger,
                         writer: CheckpointWriter) -> None:
    """Each checkpoint published since the last call: the guard's last checkpoint, a line, a W&B artifact."""
    for written in writer.written():
        guard.saved(written.path)
        _say(trainer, f"checkpoint {written.path}")
        logger.checkpoint(written.path, written.step)


def _finish_write_after_error(writer: CheckpointWriter) -> None:
    """A run that fails lets the write in flight finish: that checkpoint was staged before the fault. Its
    own failure is only a warning (the first error is the one raised)."""
    try:
        writer.wait()
    except checkpoint.CheckpointError as err:
        print_warning(str(err))


def finish(trainer: Trainer, logger: metrics.MetricsLogger, sample: bool = True) -> None:
    """The data summary (bad records skipped, per file), the end-of-run sample (every rank takes
    part: stages pass activations, tp ranks share logits; none after a stop on a signal), then the
    data workers and the logger stop."""
    train = trainer.cfg.train
    bad = trainer.batches.bad_records(gather=True)  # a collective when ranks read different streams
    if bad:
        total = sum(n for reasons in bad.values() for n in reasons.values())
        lines = [f"  {file}: " + ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))
                 for file, reasons in sorted(bad.items())]
        _say(trainer, f"data: {total} bad record(s) skipped (data.on_bad_record=skip):\n" + "\n".join(lines))
        logger.summary({"data/bad_records": total})
    if sample and train.sample_tokens > 0:
        from train.sample import sample_text

        bf16 = resolve_precision(train.precision, trainer.device) != "fp32"
        text, _ = sample_text(trainer.engine.module, trainer.model_cfg, trainer.topology, train.sample_prompt,
                              train.sample_tokens, trainer.device, train.seed, bf16=bf16)
        _say(trainer, "sample:\n" + text)
        logger.sample(trainer.progress.step, train.sample_prompt, text)
    trainer.batches.close()
    logger.close()


def _due(step: int, interval: int, last: int) -> bool:
    return step == last or (interval > 0 and step % interval == 0)


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def _progress_line(record: dict, max_steps: int, eta: float) -> str:
    loss = record["train/loss"]
    parts = [
        f"step {record['step']:>{len(str(max_steps))}}/{max_steps}",
        f"loss {loss:.4f}" if loss is not None else "loss -",
        f"lr {record['train/lr']:.2e}",
    ]
    if record["train/grad_norm"] is not None:
        parts.append(f"grad {record['train/grad_norm']:.2f}")
    if record["train/skipped_steps"]:
        parts.append(f"skipped {record['train/skipped_steps']}")
    if "val/loss" in record:
        parts.append(f"val {record['val/loss']:.4f}")
    parts.append(f"{record['perf/tokens_per_s']:,.0f} tok/s")
    if record["perf/mfu"] is not None:
        predicted = record.get("perf/mfu_predicted")
        plan = f" (plan {100 * predicted:.1f}%)" if predicted is not None else ""
        parts.append(f"mfu {100 * record['perf/mfu']:.1f}%{plan}")
    parts.append(f"eta {_duration(eta)}")
    return " | ".join(parts)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _say(trainer: Trainer, text: str) -> None:
    if trainer.topology.rank == 0:
        print(text, flush=True)
