"""Run metrics: Weights & Biases (offline by default) plus a local mirror, <run dir>/metrics.jsonl, and
the `Meter` that turns the steps between two records into one (loss, throughput, MFU, memory).

Throughput and utilisation use the PaLM count of training FLOPs per token (model/gpt.py:
flops_per_token). MFU = achieved FLOP/s ÷ (peak FLOP/s per device × devices), the peak either
configured (logging.peak_tflops) or looked up by GPU name in GPU_PEAK_TFLOPS.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import time
from pathlib import Path

import torch

from model import GPT, GPTConfig, count_parameters, flops_per_token
from train.config.sections import LoggingConfig
from train.monitor import report

# Peak dense bf16 tensor-core FLOP/s by GPU name fragment (vendor data sheets, without sparsity); the
# first fragment found in the device name wins, so longer names come before their prefixes.
GPU_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "A10G": 125.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "V100": 125.0,
}


def mfu(tokens_per_s: float, flops_per_tok: int, peak_tflops_per_device: float | None, devices: int):
    """Model FLOPs utilisation, or None when the device's peak is unknown."""
    if not peak_tflops_per_device:
        return None
    return tokens_per_s * flops_per_tok / (peak_tflops_per_device * 1e12 * devices)


def peak_tflops(device, configured: float | None) -> float | None:
    """Per-device peak for MFU: the configured value, else the GPU's from GPU_PEAK_TFLOPS (None on CPU)."""
    if configured is not None:
        return float(configured)
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((tflops for fragment, tflops in GPU_PEAK_TFLOPS.items() if fragment in name), None)


def _final_and_best(record: dict, summary) -> dict:
    """The summary entries a record updates: <key>_final and <key>_best of val/loss (lowest best) and of
    every eval/<task>/<metric> (highest best; perplexity, ppl, the lowest)."""
    updates = {}
    for key, value in record.items():
        if value is None or not (key == "val/loss" or key.startswith("eval/")):
            continue
        better = min if key == "val/loss" or key.endswith("/ppl") else max
        best = summary.get(f"{key}_best")
        updates[f"{key}_final"], updates[f"{key}_best"] = value, value if best is None else better(best, value)
    return updates


class MetricsLogger:
    """Writes one JSON object per logged step to metrics.jsonl and the same dict to W&B, and, with
    logging.tensorboard, each of its numbers as a TensorBoard scalar at the step.

    Only the process that should log (rank 0) constructs an active logger; others pass active=False.
    A write that fails (the run folder full or read-only, W&B's files or service failing) never stops
    training: the first failure of each target is one warning, and the writes it could not take (records;
    for W&B also the summary, sample, artifact and finish) are counted (`unwritten`) and said in one more
    warning when the logger closes.
    """

    def __init__(self, run_dir: Path, logging_cfg: LoggingConfig, run_config: dict, active: bool, resumed_step: int | None,
                 resumed: bool = False, default_name: str | None = None, first_record: dict | None = None):
        """resumed_step: the step this run starts from; records logged after it by a run that stopped are
        dropped from metrics.jsonl, since they are about to be logged again. resumed: whether the run
        continues a checkpoint of this run folder; then it continues that run's W&B run (same id, marked
        resumed), else it is a new W&B run with a new id (wandb_run_id). default_name: the W&B run's name
        when logging.wandb.name is null (else the run folder's name). first_record: values the first record this
        start logs also holds (the layout it trains at, which an elastic restart may change).

        The W&B summary holds val/loss_final (the last validation loss) and val/loss_best (the lowest),
        and for every task metric eval/<task>/<metric> (train.eval_tasks) its _final and _best (the
        highest; perplexity the lowest), over the records this process logged (a resume starts them
        again from the run's W&B summary)."""
        self.active = active
        self.run = None
        self.tensorboard = None
        self.first_record = dict(first_record or {})
        self.val_losses: list[float] = []
        self.unwritten: dict[str, int] = {}  # records a target could not take: {"metrics.jsonl" | "W&B": n}
        self.logged = 0
        default_name = default_name or Path(run_dir).name
        if not active:
            return
        self.path = Path(run_dir) / "metrics.jsonl"
        if resumed_step is not None and self.path.exists():
            _truncate_after(self.path, resumed_step)
        if logging_cfg.tensorboard:  # events after the step resumed from, left by a killed run, are purged
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"),
                                             purge_step=resumed_step + 1 if resumed_step else None)
        mode = logging_cfg.wandb.mode  # one of WANDB_MODES (train/config/sections/logging.py)
        if mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            w = logging_cfg.wandb
            self.run = wandb.init(
                project=w.project,
                entity=w.entity,
                group=w.group,
                tags=list(w.tags or []),
                notes=w.notes,
                job_type=w.job_type,
                name=w.name or default_name,
                dir=str(run_dir),
                mode=mode,
                config=run_config,
                resume="allow" if resumed else None,
                id=wandb_run_id(run_dir, resumed),
                settings=wandb.Settings(resumed=resumed),  # offline there is no server to say so
            )
            self.run.define_metric("tokens")  # every chart can plot against tokens seen
            for prefix in ("train/*", "val/*", "eval/*", "perf/*", "data/*"):
                self.run.define_metric(prefix, step_metric="tokens")
            self.log_checkpoints = bool(w.log_checkpoints)

    def log(self, record: dict) -> None:
        if not self.active:
            return
        record, self.first_record = {**record, **self.first_record}, {}
        self.logged += 1
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as err:
            self._failed("metrics.jsonl", err)
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(key, value, global_step=record["step"])
            self.tensorboard.flush()
        if self.run is not None:
            self._wandb(self._wandb_log, record)

    def _wandb_log(self, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if v is not None and k != "step"}, step=record["step"])
        self.run.summary.update(_final_and_best(record, self.run.summary))

    def _wandb(self, call, *args) -> None:
        """`call(*args)` on the W&B run; its failure is counted and warned of once, never raised."""
        try:
            call(*args)
        except Exception as err:  # W&B's own errors have no common base; none may stop training
            self._failed("W&B", err)

    def _failed(self, target: str, err: Exception) -> None:
        """A record `target` could not take: counted; the first one of each target is one warning."""
        if target not in self.unwritten:
            report.warn(f"{target} cannot be written ({getattr(err, 'strerror', None) or err}); training goes on, "
                        f"and what it cannot take is counted")
        self.unwritten[target] = self.unwritten.get(target, 0) + 1

    def summary(self, values: dict) -> None:
        if self.run is not None:
            self._wandb(self.run.summary.update, values)

    def sample(self, step: int, prompt: str, text: str) -> None:
        """The end-of-run sample, as a W&B table (step, prompt, sample)."""
        if self.run is not None:
            import wandb

            table = wandb.Table(columns=["step", "prompt", "sample"], data=[[step, prompt, text]])
            self._wandb(self.run.log, {"samples": table}, step)

    def checkpoint(self, path: Path, step: int) -> None:
        """A checkpoint folder as a W&B artifact (type "checkpoint"), when logging.wandb.log_checkpoints is set."""
        if self.run is not None and self.log_checkpoints:
            import wandb

            artifact = wandb.Artifact(f"{self.run.id}-checkpoint", type="checkpoint", metadata={"step": step})
            self._wandb(self._log_artifact, artifact, path, step)

    def _log_artifact(self, artifact, path: Path, step: int) -> None:
        artifact.add_dir(str(path))
        self.run.log_artifact(artifact, aliases=[f"step{step}", "latest"])

    def close(self) -> None:
        """Finish the W&B run, and say how many records a target could not take."""
        if self.run is not None:
            self._wandb(self.run.finish)
            self.run = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.unwritten:
            counts = ", ".join(f"{n} to {target}" for target, n in self.unwritten.items())
            report.warn(f"writes that failed and were skipped: {counts} (of {self.logged} metrics records this start)")
            self.unwritten = {}


def run_record(config: dict, schedule, layout: dict, global_batch: int, seq_len: int, plan) -> dict:
    """The config W&B records for a run: the composed config with every value the run resolved put in place
    (optim.lr and the schedule as the run follows them, e.g. the capped warmup or a resumed schedule), plus
    `run`: the layout, the global batch in sequences and tokens, the planner's prediction (CUDA), and which
    gpt3d (version, git commit) ran."""
    config = dict(config)
    config["optim"] = {**config.get("optim", {}), "lr": schedule.peak_lr, "warmup_tokens": schedule.warmup_tokens,
                       "decay_tokens": schedule.decay_tokens, "min_lr_ratio": schedule.min_lr_ratio}
    config["run"] = {
        "layout": layout,
        "global_batch_sequences": global_batch,
        "global_batch_tokens": global_batch * seq_len,
        "plan": plan.to_json() if plan is not None else None,
        "gpt3d_version": _version(),
        "git_commit": _git_commit(),
    }
    return config


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpt3d")
    except PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """The commit of the checkout this code runs from (None outside a git checkout)."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _truncate_after(path: Path, step: int) -> None:
    """Keep the records of steps ≤ step (written to a temporary file, then renamed over the old one)."""
    kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
    write_atomically(path, "".join(line + "\n" for line in kept))


def write_atomically(path: Path, text: str) -> None:
    """`text` into a run-directory file: written to <path>.tmp, then renamed over `path`, so a reader
    (or a run killed meanwhile) sees the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(run_dir: Path, resumed: bool) -> str:
    """The W&B run id of a run folder's run: a resume continues the id recorded in <run dir>/wandb_run_id
    (folders of older versions, without that file: the hash of the folder's path they used); a fresh start
    draws a new random id and records it, so two runs in one folder are never one W&B run."""
    path = Path(run_dir) / WANDB_ID_FILE
    if resumed:
        if path.exists():
            return path.read_text().strip()
        import hashlib

        return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    import secrets

    run_id = secrets.token_hex(8)
    write_atomically(path, run_id + "\n")
    return run_id


class Meter:
    """Training loss and throughput between two log records. The loss stays on the device: no
    all-reduce or host sync in every step, one when a record is taken."""

    def __init__(self, device: torch.device, world: int, cfg: GPTConfig, peak: float | None, batches, plan, run_tokens: int):
        """`world` devices train `cfg`'s model, each of `peak` TFLOP/s (None: unknown, no MFU); `batches`
        (TrainBatches) reports the data wait and mixture shares; `plan` (or None) the predicted MFU;
        `run_tokens` the tokens by train.max_steps, for the time left."""
        self.device, self.world = device, world
        self.seq_len = cfg.seq_len
        self.flops_per_token = flops_per_token(
            count_parameters(full_shapes_model(cfg), exclude_positions=True), cfg.n_layer, cfg.d_model, cfg.seq_len
        )
        self.peak = peak
        self.batches, self.plan = batches, plan
        self.run_tokens = run_tokens
        self.eta_s = math.nan  # seconds until max_steps at the last record's speed
        self.restart()

    def restart(self) -> None:
        self.losses: list[tuple[torch.Tensor, torch.Tensor | bool]] = []  # each step's (loss, skipped), on the device
        self.steps, self.tokens, self.batch_size = 0, 0, None
        self.clock = time.perf_counter()

    def add(self, loss: torch.Tensor, batch_size: int, skipped: torch.Tensor | bool = False) -> None:
        """One step and its global batch (sequences); a skipped step's (non-finite) loss stays out of
        the mean, its time and tokens stay in. `skipped` may be the step's device flag (1.0: skipped):
        the step's loss and flag are kept as they are and combined when a record is taken (no kernel, no
        read now)."""
        self.losses.append((loss, skipped))
        self.steps += 1
        self.tokens += batch_size * self.seq_len
        self.batch_size = batch_size

    def _applied_losses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ loss over the applied steps, their count) since the last record, on the device."""
        if not self.losses:
            zero = torch.zeros((), dtype=torch.float64, device=self.device)
            return zero, zero
        applied = torch.stack([1 - torch.as_tensor(skipped, dtype=torch.float64, device=self.device)
                               for _, skipped in self.losses])  # (steps,)
        losses = torch.stack([loss.double() for loss, _ in self.losses])  # (steps,)
        return torch.where(applied > 0, losses, 0.0).sum(), applied.sum()  # a skipped step's loss may be NaN

    def _shares(self) -> dict:
        """The realised share of each source of a mixture (data=mixture), as data/share/<label>."""
        shares = self.batches.mixture_shares()
        return {f"data/share/{label}": share for label, share in shares.items()} if len(shares) > 1 else {}

    @contextlib.contextmanager
    def paused(self):
        started = time.perf_counter()
        yield
        self.clock += time.perf_counter() - started

    def glance(self, progress, result, skipped_steps: int) -> dict:
        """The first keys of the record of the steps since the last one (step, tokens, mean loss over the
        applied steps and the ranks, None when every step since was skipped; learning rate, gradient norm,
        skipped steps so far, batch, throughput, MFU; and the data reads retried by every rank), without
        starting a new record: a line can show them before the record is due. Averaging the loss is a
        collective: every rank calls this alike."""
        elapsed = time.perf_counter() - self.clock
        tokens_per_s = self.tokens / elapsed
        # one collective: every rank takes part, skips or not; the loss averaged, the data reads retried summed
        loss_sum, applied, read_retries = sums_over_ranks([*self._applied_losses(), self.batches.read_retries])
        loss_sum /= self.world
        applied = round(applied / self.world)  # the same on every rank: the ranks skip together
        finite = result.grad_norm is not None and math.isfinite(result.grad_norm)
        return {
            "step": progress.step,
            "tokens": progress.tokens,
            "train/loss": loss_sum / applied if applied else None,
            "train/lr": result.lr,
            "train/grad_norm": result.grad_norm if finite else None,
            "train/skipped_steps": skipped_steps,
            "train/batch_size": self.batch_size,  # sequences in the last step's global batch
            "perf/tokens_per_s": tokens_per_s,
            "perf/tflops": tokens_per_s * self.flops_per_token / self.world / 1e12,
            "perf/mfu": mfu(tokens_per_s, self.flops_per_token, self.peak, self.world),
            "data/read_retries": int(read_retries),  # reads of data retried so far, by every rank (this start)
        }

    def take(self, progress, result, skipped_steps: int) -> dict:
        """The metrics record of the steps since the last one (`glance`'s keys, then memory, data wait, read
        retries, mixture shares and the predicted MFU); the time left (`eta_s`) at its throughput."""
        record = self.glance(progress, result, skipped_steps)
        self.eta_s = self.eta(progress.tokens, record["perf/tokens_per_s"])
        read_retries = record.pop("data/read_retries")
        record.update({
            "perf/max_mem_gib": max_memory_gib(self.device),
            "perf/data_wait_s": self.batches.pop_wait_seconds(),
            "data/read_retries": read_retries,
            **self._shares(),
            **({"perf/mfu_predicted": self.plan.predicted_mfu} if self.plan is not None else {}),
        })
        return record

    def eta(self, tokens: int, tokens_per_s: float | None = None) -> float:
        """Seconds until train.max_steps from `tokens` trained on, at `tokens_per_s` (None: the throughput since
        the last record, read on this rank alone: no collective)."""
        if tokens_per_s is None:
            elapsed = time.perf_counter() - self.clock
            tokens_per_s = self.tokens / elapsed if self.tokens and elapsed > 0 else 0.0
        return (self.run_tokens - tokens) / tokens_per_s if tokens_per_s > 0 else math.nan


def full_shapes_model(model_cfg: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(model_cfg)  # the unsharded model's shapes, for counting


def mean_over_ranks(value) -> float:
    """Mean of a per-rank number over all ranks (on the accelerator: nccl reduces no CPU tensors)."""
    import torch.distributed as dist

    (total,) = sums_over_ranks([value])
    return total / dist.get_world_size()


def sums_over_ranks(values: list) -> list[float]:
    """Each of several per-rank numbers (floats, ints or 0-d tensors) summed over all ranks, in one
    all-reduce (on the accelerator: nccl reduces no CPU tensors)."""
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values])
    if dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


def max_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB → GiB
