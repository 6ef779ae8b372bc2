"""What one run does: build, resume, then step, log, evaluate and checkpoint until max_steps, finish.

One optimizer step = one global batch of `train.global_batch_size` windows, or, under a batch-size
ramp (`train.batch_ramp`, train/batch_ramp.py), of the ramp's size at the tokens seen so far. This
rank takes its data-parallel slice (global / dp windows) and runs it as micro batches of
`train.micro_batch_size` (train/step.py); DeepSpeed accumulates and steps at the boundary. The
learning rate follows the tokens seen (train/optimizer.py: TokenLR).
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from model import GPT, GPTConfig, count_parameters
from train import batch_ramp, checkpoint, data, engine as engines, metrics, resume_checks
from train.optimizer import TokenLR, make_optimizer
from train.safeguards import Safeguards
from train.step import TrainStep


@dataclass
class Progress:
    """Loop counters that survive a resume."""

    step: int = 0
    tokens: int = 0

    def advance(self, tokens: int) -> None:
        self.step += 1
        self.tokens += tokens


@dataclass
class Trainer:
    """Everything a built run holds: where it runs, this rank's engine and step, its data."""

    cfg: object
    run_dir: Path
    device: torch.device
    topology: object
    model_cfg: GPTConfig
    engine: object
    step: TrainStep
    batches: data.TrainBatches
    val_batches: list[torch.Tensor]
    ramp: batch_ramp.BatchRamp  # global batch size (sequences) by tokens seen
    lr: TokenLR  # the learning rate by tokens seen
    plan: object | None  # the planner's prediction for this run (train/plan.py), on CUDA
    schedule: resume_checks.RunSchedule  # the LR schedule, and what checkpoints record of it


def run(cfg, run_dir: Path) -> Progress:
    """Train per `cfg` into `run_dir`; returns the final step and token count."""
    trainer = build(cfg, run_dir)
    progress, resumed_from = resume(trainer)
    # rows after the step this run starts from (0: none) are from a run killed before its next checkpoint
    logger, meter = open_logger(trainer, progress.step), Meter(trainer)
    guard = Safeguards(cfg, run_dir, trainer.engine, trainer.topology.rank, lambda text: _say(trainer, text),
                       resumed_from)
    try:
        stopped = loop(trainer, progress, logger, meter, guard)
    except BaseException:
        trainer.batches.close()
        logger.close()
        raise
    finally:
        guard.close()
    finish(trainer, logger, sample=not stopped)
    return progress


def loop(trainer: Trainer, progress: Progress, logger: metrics.MetricsLogger, meter: Meter, guard: Safeguards) -> bool:
    """Step, log (+ evaluate), checkpoint until train.max_steps; True when a signal stopped it early.

    Faults (train/safeguards.py): a step skipped for a non-finite loss or gradient is counted, and too
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
        if _due(progress.step, cfg.logging.log_interval, last):
            record = meter.take(progress, result, guard.skips.total)
            if trainer.val_batches and _due(progress.step, cfg.train.eval_interval, last):
                guard.phase(f"evaluation after step {progress.step}")
                record["val/loss"] = evaluate(trainer)
            logger.log(record)
            _say(trainer, _progress_line(record, last, meter.eta_s))
            meter.restart()
        guard.check_skips(progress.step, trainer.device)  # too many skipped in a row: NonFiniteError
        saved = None
        if _due(progress.step, cfg.train.checkpoint_interval, last):
            with meter.paused():  # saving time is not training throughput
                saved = save_checkpoint(trainer, progress, guard)
        verdict = guard.agree(progress.step, result)  # the step's one collective: a stop signal on any rank?
        if verdict.signal:
            saved = saved or save_checkpoint(trainer, progress, guard)
            guard.stopped(progress.step, verdict, saved, finished=progress.step == last)
            return progress.step < last
    return False


def build(cfg, run_dir: Path) -> Trainer:
    """Device, process group, layout, this rank's model in a DeepSpeed engine, and its data."""
    from parallel.build import BuildOptions, build_model
    from parallel.topology import Topology

    device = engines.resolve_device(cfg.train.device)
    engines.init_distributed(device, cfg.train.collective_timeout_s)
    topology = Topology.create(cfg.parallel.tp, cfg.parallel.pp)
    model_cfg = GPTConfig.from_dict(OmegaConf.to_container(cfg.model))
    ramp = batch_ramp.from_config(cfg.train, model_cfg.seq_len)

    torch.manual_seed(cfg.train.seed)
    options = BuildOptions(cfg.parallel.sequence_parallel, cfg.parallel.activation_checkpointing)
    model = build_model(model_cfg, topology, cfg.train.seed, device, options)
    if cfg.train.init_from is not None:  # a Hugging Face GPT-2 folder (train/export.py): its weights, sliced
        from parallel.naming import load_full_
        from train.export import read_init_weights

        load_full_(model, read_init_weights(Path(cfg.train.init_from), model_cfg), model_cfg, topology)
    pipelined = topology.pp_size > 1
    # A PipelineModule brings its own grid (same topology) and DeepSpeed then wants no mpu of ours.
    mpu = model.mpu() if pipelined else topology.mpu
    # the schedule of a run of ramp.tokens_after(max_steps) tokens; a resume keeps its checkpoint's
    run_schedule = resume_checks.schedule_for_run(cfg, model_cfg.name, ramp.tokens_after(cfg.train.max_steps), run_dir)
    schedule = run_schedule.schedule
    optimizer = make_optimizer(model, cfg.optim, schedule.peak_lr, clip=cfg.parallel.zero_stage == 0, mpu=mpu)
    lr = TokenLR(optimizer, schedule, ramp.size_at(0) * model_cfg.seq_len)
    engine = engines.create_engine(
        model,
        optimizer,
        lr,
        engines.deepspeed_config(cfg, topology.dp_size, device),
        mpu=None if pipelined else mpu,
    )
    # Ranks of one data-parallel replica (its tp and pp ranks) read the same windows.
    train, dp = cfg.train, (topology.dp_rank, topology.dp_size)
    speaks = topology.tp_rank == 0 and topology.pp_rank == 0  # one warning per data-parallel replica
    batches = data.TrainBatches(cfg.data, model_cfg.seq_len, train.global_batch_size, *dp, train.seed, warn=speaks)
    val_batches = []
    if train.eval_interval > 0 and train.eval_batches > 0:
        val_batches = data.validation_batches(cfg.data, model_cfg.seq_len, train.global_batch_size, train.eval_batches, *dp)
    step = TrainStep(engine, train.micro_batch_size, device)
    plan = _plan(cfg, run_dir, topology.rank) if device.type == "cuda" else None
    trainer = Trainer(cfg, run_dir, device, topology, model_cfg, engine, step, batches, val_batches, ramp, lr, plan,
                      run_schedule)
    _say(
        trainer,
        f"model {model_cfg.name}: {count_parameters(_full_shapes(model_cfg)) / 1e6:.2f}M parameters | "
        f"{topology.world_size} process(es) on {device} (tp={topology.tp_size} pp={topology.pp_size} "
        f"dp={topology.dp_size} zero={cfg.parallel.zero_stage}) | {_batch_line(ramp)} | run dir {run_dir}",
    )
    return trainer


def _batch_line(ramp: batch_ramp.BatchRamp) -> str:
    tokens = ramp.full * ramp.seq_len
    if not ramp.enabled:
        return f"{tokens} tokens/step"
    return (f"batch ramp {ramp.start} → {ramp.full} sequences by {ramp.increment} over {ramp.ramp_tokens:,} tokens, "
            f"then {tokens} tokens/step")


def resume(trainer: Trainer) -> tuple[Progress, Path | None]:
    """Load the checkpoint train.resume names, if any, at this run's layout (whatever layout saved
    it): weights, optimizer, schedule, RNG, data position; (progress, the step folder loaded or None)."""
    path = checkpoint.find_resume_path(trainer.cfg.train.resume, trainer.run_dir)
    if path is None:
        return Progress(), None
    state = checkpoint.load(trainer.engine, trainer.topology, trainer.model_cfg, path)  # TokenLR: its tokens
    trainer.batches.load_state_dict(state["data"])
    trainer.batches.start()  # background workers (data.workers) begin packing from the restored position
    saved, now = state["layout"], checkpoint.layout_of(trainer.engine, trainer.topology)
    moved = "" if saved == now else f" (saved at {_layout_text(saved)}, now {_layout_text(now)})"
    _say(trainer, f"resumed from {state['path']} at step {state['step']}{moved}")
    return Progress(state["step"], state["tokens"]), state["path"]


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
    """metrics.jsonl and W&B, on rank 0 only; records after `resumed_step` are dropped (see MetricsLogger)."""
    run_config = OmegaConf.to_container(trainer.cfg, resolve=True)
    if trainer.plan is not None:
        run_config["plan"] = trainer.plan.to_json()
    return metrics.MetricsLogger(trainer.run_dir, trainer.cfg.logging, run_config, active=trainer.topology.rank == 0,
                                 resumed_step=resumed_step)


def evaluate(trainer: Trainer) -> float:
    """Mean next-token loss over the held-out windows, averaged over all ranks."""
    return _mean_over_ranks(_mean(trainer.step.evaluate(trainer.val_batches)))


def save_checkpoint(trainer: Trainer, progress: Progress, guard: Safeguards) -> Path:
    """A checkpoint of the run after this step (train/checkpoint.py), then retention; never one of
    non-finite weights (NonFiniteError instead)."""
    train = trainer.cfg.train
    guard.phase(f"checkpoint at step {progress.step}")
    guard.before_saving(progress.step, trainer.device)
    data_state = trainer.batches.state_dict()  # a collective when ranks read different streams
    path = checkpoint.save(trainer.engine, trainer.topology, trainer.model_cfg, trainer.run_dir, progress.step,
                           progress.tokens, data_state, extra={"schedule": trainer.schedule.state},
                           keep=train.keep_checkpoints, keep_every=train.keep_every)
    guard.saved(path)
    _say(trainer, f"checkpoint {path}")
    return path


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
        from train.generate import sample_text

        text, _ = sample_text(trainer.engine.module, trainer.model_cfg, trainer.topology, train.sample_prompt,
                              train.sample_tokens, trainer.device, train.seed)
        _say(trainer, "sample:\n" + text)
    trainer.batches.close()
    logger.close()


class Meter:
    """Training loss and throughput between two log records. The loss stays on the device: no
    all-reduce or host sync in every step, one when a record is taken."""

    def __init__(self, trainer: Trainer):
        self.device, self.world = trainer.device, trainer.topology.world_size
        cfg = trainer.model_cfg
        self.seq_len = cfg.seq_len
        self.flops_per_token = metrics.flops_per_token(
            count_parameters(_full_shapes(cfg), exclude_positions=True), cfg.n_layer, cfg.d_model, cfg.seq_len
        )
        self.peak = metrics.peak_tflops(trainer.device, trainer.cfg.logging.peak_tflops)
        self.batches, self.plan = trainer.batches, trainer.plan
        self.run_tokens = trainer.ramp.tokens_after(trainer.cfg.train.max_steps)
        self.eta_s = math.nan  # seconds until max_steps at the last record's speed
        self.restart()

    def restart(self) -> None:
        self.loss_sum, self.steps, self.applied = torch.zeros((), dtype=torch.float64, device=self.device), 0, 0
        self.tokens, self.batch_size = 0, None
        self.clock = time.perf_counter()

    def add(self, loss: torch.Tensor, batch_size: int, skipped: bool = False) -> None:
        """One step and its global batch (sequences); a skipped step's (non-finite) loss stays out of
        the mean, its time and tokens stay in."""
        if not skipped:
            self.loss_sum += loss
            self.applied += 1
        self.steps += 1
        self.tokens += batch_size * self.seq_len
        self.batch_size = batch_size

    def _shares(self) -> dict:
        """The realised share of each source of a mixture (data=mixture), as data/share/<label>."""
        shares = self.batches.mixture_shares()
        return {f"data/share/{label}": share for label, share in shares.items()} if len(shares) > 1 else {}

    @contextlib.contextmanager
    def paused(self):
        started = time.perf_counter()
        yield
        self.clock += time.perf_counter() - started

    def take(self, progress: Progress, result, skipped_steps: int) -> dict:
        """The metrics record of the steps since the last one (mean loss over the applied steps and the
        ranks; None when every step since was skipped) and the run's skipped steps so far."""
        elapsed = time.perf_counter() - self.clock
        tokens_per_s = self.tokens / elapsed
        self.eta_s = (self.run_tokens - progress.tokens) / tokens_per_s
        loss_sum = _mean_over_ranks(self.loss_sum)  # a collective: every rank takes part, skips or not
        finite = result.grad_norm is not None and math.isfinite(result.grad_norm)
        return {
            "step": progress.step,
            "tokens": progress.tokens,
            "train/loss": loss_sum / self.applied if self.applied else None,
            "train/lr": result.lr,
            "train/grad_norm": result.grad_norm if finite else None,
            "train/skipped_steps": skipped_steps,
            "train/batch_size": self.batch_size,  # sequences in the last step's global batch
            "perf/tokens_per_s": tokens_per_s,
            "perf/tflops": tokens_per_s * self.flops_per_token / self.world / 1e12,
            "perf/mfu": metrics.mfu(tokens_per_s, self.flops_per_token, self.peak, self.world),
            "perf/max_mem_gib": _max_memory_gib(self.device),
            "perf/data_wait_s": self.batches.pop_wait_seconds(),
            **self._shares(),
            **({"perf/mfu_predicted": self.plan.predicted_mfu} if self.plan is not None else {}),
        }


def _plan(cfg, run_dir: Path, rank: int):
    """The planner's prediction for this run on this GPU, written to <run dir>/plan.json by rank 0."""
    from train.plan import plan_for_run

    plan = plan_for_run(cfg)
    if rank == 0:
        metrics.write_atomically(Path(run_dir) / "plan.json", json.dumps(plan.to_json(), indent=2) + "\n")
    return plan


def _full_shapes(model_cfg: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(model_cfg)  # the unsharded model's shapes, for counting


def _due(step: int, interval: int, last: int) -> bool:
    return step == last or (interval > 0 and step % interval == 0)


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def _mean_over_ranks(value) -> float:
    """Mean of a per-rank number over all ranks (on the accelerator: nccl reduces no CPU tensors)."""
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.as_tensor(value, dtype=torch.float64, device=device).reshape(1)
    if dist.get_world_size() > 1:
        dist.all_reduce(tensor)
        tensor /= dist.get_world_size()
    return float(tensor)


def _max_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB → GiB


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
