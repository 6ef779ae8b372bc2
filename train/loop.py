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
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from model import GPT, GPTConfig, count_parameters
from train import batch_ramp, checkpoint, data, engine as engines, metrics
from train.optimizer import TokenLR, make_optimizer, make_schedule
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


def run(cfg, run_dir: Path) -> Progress:
    """Train per `cfg` into `run_dir`; returns the final step and token count."""
    trainer = build(cfg, run_dir)
    progress, resumed = resume(trainer)
    logger, meter = open_logger(trainer, progress.step if resumed else None), Meter(trainer)
    last = cfg.train.max_steps
    while progress.step < last:
        windows, size = next_batch(trainer, progress)
        result = trainer.step(windows)
        progress.advance(size * trainer.model_cfg.seq_len)
        meter.add(result.loss, size)
        if _due(progress.step, cfg.logging.log_interval, last):
            record = meter.take(progress, result)
            if trainer.val_batches and _due(progress.step, cfg.train.eval_interval, last):
                record["val/loss"] = evaluate(trainer)
            logger.log(record)
            _say(trainer, _progress_line(record, last, meter.eta_s))
            meter.restart()
        if _due(progress.step, cfg.train.checkpoint_interval, last):
            with meter.paused():  # saving time is not training throughput
                save_checkpoint(trainer, progress)
    finish(trainer, logger)
    return progress


def build(cfg, run_dir: Path) -> Trainer:
    """Device, process group, layout, this rank's model in a DeepSpeed engine, and its data."""
    from parallel.build import BuildOptions, build_model
    from parallel.topology import Topology

    device = engines.resolve_device(cfg.train.device)
    engines.init_distributed(device)
    topology = Topology.create(cfg.parallel.tp, cfg.parallel.pp)
    model_cfg = GPTConfig.from_dict(OmegaConf.to_container(cfg.model))
    ramp = batch_ramp.from_config(cfg.train, model_cfg.seq_len)

    torch.manual_seed(cfg.train.seed)
    options = BuildOptions(cfg.parallel.sequence_parallel, cfg.parallel.activation_checkpointing)
    model = build_model(model_cfg, topology, cfg.train.seed, device, options)
    pipelined = topology.pp_size > 1
    # A PipelineModule brings its own grid (same topology) and DeepSpeed then wants no mpu of ours.
    mpu = model.mpu() if pipelined else topology.mpu
    schedule = make_schedule(cfg.optim, model_cfg.name, ramp.tokens_after(cfg.train.max_steps))
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
    trainer = Trainer(cfg, run_dir, device, topology, model_cfg, engine, step, batches, val_batches, ramp, lr, plan)
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


def resume(trainer: Trainer) -> tuple[Progress, bool]:
    """Load the checkpoint train.resume names, if any: engine, RNG, data position; (progress, resumed)."""
    path = checkpoint.find_resume_path(trainer.cfg.train.resume, trainer.run_dir)
    if path is None:
        return Progress(), False
    state = checkpoint.load(trainer.engine, path)
    trainer.batches.load_state_dict(state["data"])
    trainer.batches.start()  # background workers (data.workers) begin packing from the restored position
    _say(trainer, f"resumed from {path} at step {state['step']}")
    return Progress(state["step"], state["tokens"]), True


def next_batch(trainer: Trainer, progress: Progress) -> tuple[torch.Tensor, int]:
    """This rank's windows of the next global batch and that batch's size in sequences: the ramp's
    size at the tokens seen so far (train.batch_ramp; else train.global_batch_size). The learning rate
    is set for the tokens seen once this batch is trained on."""
    size = trainer.ramp.size_at(progress.tokens)
    trainer.lr.set_tokens(progress.tokens + size * trainer.model_cfg.seq_len)
    return trainer.batches.next_batch(size), size


def open_logger(trainer: Trainer, resumed_step: int | None) -> metrics.MetricsLogger:
    """metrics.jsonl and W&B, on rank 0 only."""
    run_config = OmegaConf.to_container(trainer.cfg, resolve=True)
    if trainer.plan is not None:
        run_config["plan"] = trainer.plan.to_json()
    return metrics.MetricsLogger(trainer.run_dir, trainer.cfg.logging, run_config, active=trainer.topology.rank == 0,
                                 resumed_step=resumed_step)


def evaluate(trainer: Trainer) -> float:
    """Mean next-token loss over the held-out windows, averaged over all ranks."""
    return _mean_over_ranks(_mean(trainer.step.evaluate(trainer.val_batches)))


def save_checkpoint(trainer: Trainer, progress: Progress) -> None:
    data_state = trainer.batches.state_dict()
    path = checkpoint.save(trainer.engine, trainer.run_dir, progress.step, progress.tokens, data_state, model=trainer.model_cfg)
    _say(trainer, f"checkpoint {path}")


def finish(trainer: Trainer, logger: metrics.MetricsLogger) -> None:
    """The data summary (bad records skipped, per file), the end-of-run sample (every rank takes
    part: stages pass activations, tp ranks share logits), then the data workers and the logger stop."""
    train = trainer.cfg.train
    bad = trainer.batches.bad_records(gather=True)  # a collective when ranks read different streams
    if bad:
        total = sum(n for reasons in bad.values() for n in reasons.values())
        lines = [f"  {file}: " + ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))
                 for file, reasons in sorted(bad.items())]
        _say(trainer, f"data: {total} bad record(s) skipped (data.on_bad_record=skip):\n" + "\n".join(lines))
        logger.summary({"data/bad_records": total})
    if train.sample_tokens > 0:
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
        self.loss_sum, self.steps = torch.zeros((), dtype=torch.float64, device=self.device), 0
        self.tokens, self.batch_size = 0, None
        self.clock = time.perf_counter()

    def add(self, loss: torch.Tensor, batch_size: int) -> None:
        """One step's loss and its global batch (sequences)."""
        self.loss_sum += loss
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

    def take(self, progress: Progress, result) -> dict:
        """The metrics record of the steps since the last one (mean loss over steps and ranks)."""
        elapsed = time.perf_counter() - self.clock
        tokens_per_s = self.tokens / elapsed
        self.eta_s = (self.run_tokens - progress.tokens) / tokens_per_s
        return {
            "step": progress.step,
            "tokens": progress.tokens,
            "train/loss": _mean_over_ranks(self.loss_sum) / self.steps,
            "train/lr": result.lr,
            "train/grad_norm": result.grad_norm,
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
        path = Path(run_dir) / "plan.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
        os.replace(tmp, path)
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
    parts = [
        f"step {record['step']:>{len(str(max_steps))}}/{max_steps}",
        f"loss {record['train/loss']:.4f}",
        f"lr {record['train/lr']:.2e}",
    ]
    if record["train/grad_norm"] is not None:
        parts.append(f"grad {record['train/grad_norm']:.2f}")
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
