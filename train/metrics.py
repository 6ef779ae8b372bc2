"""Run metrics: Weights & Biases (offline by default) plus a local mirror, <run dir>/metrics.jsonl.

Throughput and utilisation use the PaLM (Chowdhery et al. 2022, App. B) count of training
FLOPs per token:  6·N + 12·L·d·T,
N the model's parameters without the position table (the tied embedding counted once, for the
unembedding's matrix multiply; LayerNorm and bias parameters, a rounding error, included), L layers, d = d_model, T = seq_len (the attention score and value
products). MFU = achieved FLOP/s ÷ (peak FLOP/s per device × devices), the peak either
configured (logging.peak_tflops) or looked up by GPU name in GPU_PEAK_TFLOPS.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

WANDB_MODES = ("offline", "online", "disabled")

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


def flops_per_token(matmul_params: int, n_layer: int, d_model: int, seq_len: int) -> int:
    """PaLM's training FLOPs per token (forward + backward): 6N + 12·L·d·T."""
    return 6 * matmul_params + 12 * n_layer * d_model * seq_len


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


class MetricsLogger:
    """Writes one JSON object per logged step to metrics.jsonl and the same dict to W&B.

    Only the process that should log (rank 0) constructs an active logger; others pass active=False.
    """

    def __init__(self, run_dir: Path, logging_cfg, run_config: dict, active: bool, resumed_step: int | None):
        """resumed_step: the checkpoint's step when resuming; records logged after it by the run that
        stopped are dropped from metrics.jsonl, since they are about to be logged again."""
        self.active = active
        self.run = None
        if not active:
            return
        self.path = Path(run_dir) / "metrics.jsonl"
        if resumed_step is not None and self.path.exists():
            _truncate_after(self.path, resumed_step)
        resumed = resumed_step is not None
        mode = logging_cfg.wandb.mode  # one of WANDB_MODES (train/validate.py)
        if mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(
                project=logging_cfg.wandb.project,
                entity=logging_cfg.wandb.entity,
                name=logging_cfg.wandb.name or Path(run_dir).name,
                dir=str(run_dir),
                mode=mode,
                config=run_config,
                resume="allow" if resumed else None,
                id=_stable_run_id(run_dir),
            )

    def log(self, record: dict) -> None:
        if not self.active:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if v is not None and k != "step"}, step=record["step"])

    def summary(self, values: dict) -> None:
        if self.run is not None:
            self.run.summary.update(values)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


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


def _stable_run_id(run_dir: Path) -> str:
    """One W&B run per run directory, so a resumed run continues its curves."""
    import hashlib

    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
