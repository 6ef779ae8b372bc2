"""What one run does: build, shard, wrap in DeepSpeed, stream data, step, evaluate, log, save.

One optimizer step = one global batch of `train.global_batch_size` windows. This rank takes its
data-parallel slice (global / dp windows) and runs it as micro batches of
`train.micro_batch_size`; DeepSpeed accumulates and steps at the boundary.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from model import GPT, GPTConfig, count_parameters, generate
from parallel import engine as engines
from train import checkpoint, data, metrics
from train.optimizer import make_lr_scheduler, make_optimizer, make_schedule
from train.tokenizer import EOT, gpt2


@dataclass
class Progress:
    """Loop counters that survive a resume."""

    step: int = 0
    tokens: int = 0


def run(cfg, run_dir: Path) -> Progress:
    """Train per `cfg` into `run_dir`; returns the final step and token count."""
    from parallel.topology import Topology

    device = engines.resolve_device(cfg.train.device)
    engines.init_distributed(device)
    topology = Topology.create(cfg.parallel.tp, cfg.parallel.pp)
    rank = topology.rank
    model_cfg = GPTConfig.from_dict(OmegaConf.to_container(cfg.model))
    seq_len = model_cfg.seq_len
    tokens_per_step = cfg.train.global_batch_size * seq_len

    torch.manual_seed(cfg.train.seed)
    model = engines.build_model(model_cfg, cfg, topology, device)
    pipelined = topology.pp_size > 1
    # A PipelineModule brings its own grid (same topology) and DeepSpeed then wants no mpu of ours.
    mpu = model.mpu() if pipelined else topology.mpu
    schedule = make_schedule(cfg.optim, model_cfg.name, tokens_per_step, cfg.train.max_steps)
    optimizer = make_optimizer(model, cfg.optim, schedule.peak_lr, clip=cfg.parallel.zero_stage == 0, mpu=mpu)
    engine = engines.create_engine(
        model,
        optimizer,
        make_lr_scheduler(optimizer, schedule, tokens_per_step),
        engines.deepspeed_config(cfg, topology.dp_size, device),
        mpu=None if pipelined else mpu,
    )

    # Ranks of one data-parallel replica (its tp and pp ranks) read the same windows.
    batches = data.TrainBatches(
        cfg.data, seq_len, cfg.train.global_batch_size, topology.dp_rank, topology.dp_size, cfg.train.seed
    )
    val_batches = (
        data.validation_batches(
            cfg.data, seq_len, cfg.train.global_batch_size, cfg.train.eval_batches, topology.dp_rank, topology.dp_size
        )
        if cfg.train.eval_interval > 0 and cfg.train.eval_batches > 0
        else []
    )

    progress = Progress()
    resume_path = checkpoint.find_resume_path(cfg.train.resume, run_dir)
    if resume_path is not None:
        state = checkpoint.load(engine, resume_path)
        progress = Progress(state["step"], state["tokens"])
        batches.load_state_dict(state["data"])
        _say(rank, f"resumed from {resume_path} at step {progress.step}")

    with torch.device("meta"):
        full_model = GPT(model_cfg)  # the unsharded model's shapes, for counting
    n_params = count_parameters(full_model)
    flops_tok = metrics.flops_per_token(
        count_parameters(full_model, exclude_positions=True), model_cfg.n_layer, model_cfg.d_model, seq_len
    )
    peak = engines.peak_tflops(device, cfg.logging.peak_tflops)
    logger = metrics.MetricsLogger(
        run_dir,
        cfg.logging,
        OmegaConf.to_container(cfg, resolve=True),
        active=rank == 0,
        resumed_step=progress.step if resume_path is not None else None,
    )
    _say(
        rank,
        f"model {model_cfg.name}: {n_params / 1e6:.2f}M parameters | {topology.world_size} process(es) on {device} "
        f"(tp={topology.tp_size} pp={topology.pp_size} dp={topology.dp_size} zero={cfg.parallel.zero_stage}) | "
        f"{tokens_per_step} tokens/step | run dir {run_dir}",
    )

    world = topology.world_size
    # The loss stays on the device between log steps: no all-reduce or host sync in every step.
    loss_sum, steps_since_log, clock = torch.zeros((), dtype=torch.float64, device=device), 0, time.perf_counter()
    while progress.step < cfg.train.max_steps:
        micro_batches = _micro_batches(next(batches).to(device), cfg.train.micro_batch_size)
        engine.train()
        lr = engine.get_lr()[0]  # the rate this step uses; DeepSpeed advances the schedule in step()
        if pipelined:
            step_loss = engine.train_batch(data_iter=iter(micro_batches))  # 1F1B over all micro batches
        else:
            step_loss = 0.0
            for inputs, targets in micro_batches:
                loss = engine(inputs, targets)
                engine.backward(loss)
                engine.step()
                step_loss += loss.detach().float() / len(micro_batches)
        grad_norm = engine.get_global_grad_norm()
        progress.step += 1
        progress.tokens += tokens_per_step
        loss_sum += step_loss
        steps_since_log += 1
        last = progress.step == cfg.train.max_steps

        if progress.step % cfg.logging.log_interval == 0 or last:
            elapsed = time.perf_counter() - clock
            tokens_per_s = steps_since_log * tokens_per_step / elapsed
            record = {
                "step": progress.step,
                "tokens": progress.tokens,
                "train/loss": _mean_over_ranks(loss_sum) / steps_since_log,
                "train/lr": lr,
                "train/grad_norm": None if grad_norm is None else float(grad_norm),
                "perf/tokens_per_s": tokens_per_s,
                "perf/tflops": tokens_per_s * flops_tok / world / 1e12,
                "perf/mfu": metrics.mfu(tokens_per_s, flops_tok, peak, world),
                "perf/max_mem_gib": _max_memory_gib(device),
            }
            if val_batches and (progress.step % cfg.train.eval_interval == 0 or last):
                record["val/loss"] = evaluate(engine, val_batches, cfg.train.micro_batch_size, device, pipelined)
            logger.log(record)
            _say(rank, _progress_line(record, cfg.train.max_steps, elapsed / steps_since_log))
            loss_sum, steps_since_log, clock = torch.zeros_like(loss_sum), 0, time.perf_counter()

        interval = cfg.train.checkpoint_interval
        if last or (interval > 0 and progress.step % interval == 0):
            started = time.perf_counter()
            path = checkpoint.save(engine, run_dir, progress.step, progress.tokens, batches.state_dict())
            _say(rank, f"checkpoint {path}")
            clock += time.perf_counter() - started  # saving time is not training throughput

    if cfg.train.sample_tokens > 0:
        if pipelined or cfg.parallel.sequence_parallel:
            _say(rank, "sample: skipped (generation needs pp=1 without sequence parallelism; load the checkpoint so)")
        else:  # every rank runs it: tensor-parallel ranks compute the logits together
            text = sample(engine.module, topology, cfg.train.sample_prompt, cfg.train.sample_tokens, device, cfg.train.seed)
            _say(rank, "sample:\n" + text)
    logger.close()
    return progress


@torch.no_grad()
def evaluate(engine, val_batches: list[torch.Tensor], micro_batch_size: int, device, pipelined: bool) -> float:
    """Mean next-token loss over this rank's held-out windows, averaged over data-parallel ranks."""
    engine.eval()
    losses = []
    for window in val_batches:
        micro_batches = _micro_batches(window.to(device), micro_batch_size)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            if pipelined:
                losses.append(float(engine.eval_batch(data_iter=iter(micro_batches), num_micro_batches=len(micro_batches))))
            else:
                losses += [float(engine(inputs, targets)) for inputs, targets in micro_batches]
    engine.train()
    return _mean_over_ranks(sum(losses) / max(len(losses), 1))


@torch.no_grad()
def sample(model: GPT, topology, prompt: str, max_new_tokens: int, device, seed: int) -> str:
    """A top-k sample continuing `prompt`, decoded with the GPT-2 BPE (tensor-parallel ranks
    gather the vocabulary shards of the logits; equal seeds make them draw the same tokens)."""
    from parallel.tensor import FullLogits

    encoder = gpt2()
    idx = torch.tensor([encoder.encode_ordinary(prompt) or [EOT]], device=device)  # (1, T0); "" starts a document
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    whole = FullLogits(model) if topology.tp_size > 1 else model
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = generate(whole, idx, max_new_tokens, temperature=0.8, top_k=50, generator=generator)
    model.train(was_training)
    return encoder.decode(out[0].tolist())


def _micro_batches(window: torch.Tensor, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) pairs of `size` sequences from windows (n, T+1): inputs (size, T), targets shifted by one."""
    return [(m[:, :-1], m[:, 1:]) for m in window.split(size)]


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


def _progress_line(record: dict, max_steps: int, seconds_per_step: float) -> str:
    eta = (max_steps - record["step"]) * seconds_per_step
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
        parts.append(f"mfu {100 * record['perf/mfu']:.1f}%")
    parts.append(f"eta {_duration(eta)}")
    return " | ".join(parts)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)
