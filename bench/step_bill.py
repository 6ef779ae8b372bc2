"""The step bill: what one training step of `python -m train` asks of a GPU, counted on the CPU.

  python -m bench.step_bill model=gpt3-125m train.micro_batch_size=8 train.precision=bf16
  python -m bench.step_bill model=gpt3-350m train.micro_batch_size=8 train.precision=bf16 --json bill.json
  python -m bench.step_bill model=toy --top 5                                   # a few seconds

It runs the real thing: the run is resolved from the command line's overrides as `python -m train` resolves
it, built as it builds it (this rank's model in its DeepSpeed engine, with the optimizer, the LR schedule,
the data stream and the checkpointer: train/run/build.py), and its loop (train/run/loop.py) runs three steps
on fake tensors (torch's FakeTensorMode: every tensor the steps make has its real shape, dtype and strides
and no storage, so a gpt3-125m step costs seconds here). The bill is step 3, a step like any other in the
middle of a run (step 1 makes the optimizer's state and has its line; a step that logs, validates or saves is
a different bill), from the start of its step to the start of the next: the forward, backward and update,
and the loop's own per-step work (the meter, the guards, settling the step before, reading the next
batch, the step's agreement).

It prints, from bench/op_ledger.py: the kernels a CUDA GPU would launch, by kind and by source line; the
bytes they read and write; their FLOPs; every device→host read (each empties the GPU's queue); and the
step's predicted time on an H100 and an H200 from their measured ceilings (train/planner/kernel_costs.py),
beside the committed H200 measurement of the same row where there is one (bench/results/).

The GPU's choices are taken on the CPU: train.precision=auto is bf16 and model.attention_impl=auto is triton,
as on a CUDA device; the custom ops (attention, the loss's rows) are counted as the kernels CUDA runs; torch's
optimizers choose their kernels as for CUDA tensors. What the CPU cannot show is left out and said so: the
batch's copy to the GPU (one small copy a step), and several kernels an operator launches on CUDA where it
launches one on the CPU (embedding's backward sorts first), counted as one.

--json FILE writes the whole bill: the summary, the predictions and every operator.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import warnings
from collections import Counter, defaultdict
from pathlib import Path

from bench.op_ledger import Op, OpLedger

BILLED_STEP = 3  # step 1 makes the optimizer's state and, a start's first step, says its line and settles at once
PRESETS = ("h100-80g", "h200")
MEASURED = sorted(Path(__file__).resolve().parent.glob("results/*-train-small.json"))
QUIET = ["train.max_steps=10", "logging.log_interval=10", "train.eval_interval=0", "train.sample_tokens=0",
         "train.checkpoint_interval=0", "logging.wandb.mode=disabled", "logging.curves=false"]


class _Billed(Exception):
    """Stops the run once the billed step is over."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="the training config's overrides, as for python -m train")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the whole bill to FILE as JSON")
    parser.add_argument("--top", type=int, default=15, help="source lines listed by kernels (default 15)")
    args = parser.parse_args()
    if args.top < 1:
        parser.error(f"--top {args.top}: must be ≥ 1")
    bill = step_bill(args.overrides)
    print(format_bill(bill, args.top))
    if args.json:
        from train.monitor.metrics import write_atomically

        write_atomically(args.json, json.dumps(bill, indent=1) + "\n")


def step_bill(overrides: list[str]) -> dict:
    """The bill of step BILLED_STEP of the run these overrides describe (see the module docstring)."""
    ledger, spec = count_step(overrides)
    return summarize(ledger.ops, spec, overrides)


def count_step(overrides: list[str]) -> tuple[OpLedger, object]:
    """(the ledger of the billed step, the run's spec): the run built for real on the CPU, its loop on fake tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench.profile import compose
    from train.config.settings import ConfigError
    from train.run.build import build
    from train.run.loop import run
    from train.run.spec import resolve

    cfg = compose([*gpu_choices(overrides), *QUIET, "train.device=cpu"], 10)
    ledger = OpLedger()
    joined = torch.distributed.is_initialized()  # a caller's process group stays; the bill's own is ended
    with tempfile.TemporaryDirectory(prefix="gpt3d-step-bill-") as run_dir, contextlib.redirect_stdout(io.StringIO()):
        try:
            spec = resolve(cfg, Path(run_dir), overrides)
        except ConfigError as err:
            raise SystemExit(f"bench.step_bill: {err}") from None
        trainer = build(spec)
        with FakeTensorMode(allow_non_fake_inputs=True), _cuda_optimizer_defaults(), ledger, ledger.reading_hooks(), \
                _billing(ledger):
            try:
                run(spec, trainer)
            except _Billed:
                pass
        if not joined:
            torch.distributed.destroy_process_group()
    return ledger, spec


def gpu_choices(overrides: list[str]) -> list[str]:
    """The overrides with the values `auto` resolves to on a CUDA device: train.precision=bf16 and
    model.attention_impl=triton (unless the command line sets them)."""
    chosen = list(overrides)
    keys = {o.split("=", 1)[0].lstrip("+") for o in overrides}
    if "train.precision" not in keys or "train.precision=auto" in overrides:
        chosen.append("train.precision=bf16")
    if "model.attention_impl" not in keys or "model.attention_impl=auto" in overrides:
        chosen.append("model.attention_impl=triton")
    return chosen


@contextlib.contextmanager
def _cuda_optimizer_defaults():
    """torch's optimizers that are not told which kernels to use choose, for fake tensors on the CPU, what they
    choose for CUDA tensors: the multi-tensor ones (gpt3d's own AdamW is fused everywhere)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.optim import optimizer

    devices = optimizer._get_foreach_kernels_supported_devices
    optimizer._foreach_supported_types.append(FakeTensor)
    optimizer._get_foreach_kernels_supported_devices = lambda: [*devices(), "cpu"]
    try:
        yield
    finally:
        optimizer._foreach_supported_types.remove(FakeTensor)
        optimizer._get_foreach_kernels_supported_devices = devices


@contextlib.contextmanager
def _billing(ledger: OpLedger):
    """The ledger recording (and autograd's anomaly mode, which keeps each backward operator's forward line) from
    the start of step BILLED_STEP to the start of the next one, which is not run."""
    import torch

    from train.guard.safeguards import Safeguards

    begins = Safeguards.step_begins
    state = contextlib.ExitStack()

    def step_begins(guard, step: int) -> None:
        if step == BILLED_STEP + 1:
            ledger.recording = False
            state.close()
            raise _Billed
        begins(guard, step)
        if step == BILLED_STEP:
            state.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", "Anomaly Detection has been enabled")  # on purpose: see above
            state.enter_context(torch.autograd.detect_anomaly(check_nan=False))
            ledger.recording = True

    Safeguards.step_begins = step_begins
    try:
        with state:
            yield
    finally:
        Safeguards.step_begins = begins


def summarize(ops: list[Op], spec, overrides: list[str]) -> dict:
    """The bill as plain data: totals, kernels by kind and by source line, the reads, the predictions."""
    from train.planner.hardware import preset
    from train.planner.kernel_costs import Launch, step_seconds

    kernels_by_kind, bytes_by_kind, by_line, bytes_by_line = Counter(), defaultdict(float), Counter(), defaultdict(float)
    for op in ops:
        kernels_by_kind[op.kind] += op.kernels
        bytes_by_kind[op.kind] += op.bytes
        by_line[op.where] += op.kernels
        bytes_by_line[op.where] += op.bytes
    launches = [Launch(op.kind, op.kernels, op.bytes, op.flops, op.gemm, op.detail.get("head_dim"),
                       op.detail.get("backward", False)) for op in ops]
    predictions = {}
    for name in PRESETS:
        time = step_seconds(preset(name), launches)
        predictions[name] = {"step_ms": 1e3 * time.seconds, "device_busy_ms": 1e3 * time.device_busy,
                             "host_ms": 1e3 * time.host, "device_idle_ms": 1e3 * time.device_idle}
    runtime, model, train = spec.runtime, spec.model, spec.sections.train
    tokens = train.micro_batch_size * model.seq_len * (train.global_batch_size // train.micro_batch_size)
    return {
        "overrides": overrides,
        "model": model.name,
        "precision": runtime.precision,
        "micro_batch": train.micro_batch_size,
        "micro_batches": train.global_batch_size // (train.micro_batch_size * spec.dp),
        "seq_len": model.seq_len,
        "tokens": tokens,
        "kernels": sum(kernels_by_kind.values()),
        "bytes": sum(bytes_by_kind.values()),
        "flops": sum(op.flops for op in ops),
        "reads": [op.where for op in ops if op.kind == "read"],
        "late_reads": [op.where for op in ops if op.kind == "late read"],
        "by_kind": {kind: {"kernels": kernels_by_kind[kind], "bytes": bytes_by_kind[kind]} for kind in kernels_by_kind},
        "by_line": [{"where": line, "kernels": n, "bytes": bytes_by_line[line]} for line, n in by_line.most_common()
                    if n],
        "predicted": predictions,
        "measured": measured_rows(model.name, runtime.precision, model.compile, train.micro_batch_size,
                                  train.fused_loss),
        "ops": [op.__dict__ for op in ops],
    }


def measured_rows(model: str, precision: str, compiled: bool, micro_batch: int, fused_loss: bool) -> list[dict]:
    """The committed GPU measurements of this step (bench.train_speed's DeepSpeed rows: the engine's step
    without the loop), newest file last."""
    if not fused_loss:
        return []
    name = f"gpt3d deepspeed precision={precision}{' compiled' if compiled else ''}"
    rows = []
    for path in MEASURED:
        for row in json.loads(path.read_text()):
            if row["model"] == model and row["row"] == name and row["micro_batch"] == micro_batch and row["step_ms"]:
                rows.append({"gpu": row["gpu"], "step_ms": row["step_ms"], "commit": row["commit"][:7],
                             "file": f"bench/results/{path.name}"})
    return rows


def format_bill(bill: dict, top: int) -> str:
    gb = 1e9
    lines = [
        f"step bill: {bill['model']}, {bill['precision']}, micro batch {bill['micro_batch']} × {bill['seq_len']} "
        f"tokens, {bill['micro_batches']} micro batch(es) a step, one process; step {BILLED_STEP} of python -m train's "
        f"loop, a step that does not log or save",
        f"kernels {bill['kernels']:,} | bytes read + written {bill['bytes'] / gb:,.1f} GB | FLOPs "
        f"{bill['flops'] / 1e12:,.2f} T | device→host reads {len(bill['reads'])}",
        "",
        f"{'kind':<14} {'kernels':>8} {'GB':>9}",
    ]
    for kind, row in sorted(bill["by_kind"].items(), key=lambda kv: -kv[1]["kernels"]):
        if row["kernels"] or row["bytes"]:  # views, allocations, queries and reads launch nothing
            lines.append(f"{kind:<14} {row['kernels']:>8,} {row['bytes'] / gb:>9.2f}")
    lines += ["", f"{'source line (the top ' + str(top) + ' by kernels)':<66} {'kernels':>8} {'GB':>9}"]
    for row in bill["by_line"][:top]:
        lines.append(f"{row['where'][:66]:<66} {row['kernels']:>8,} {row['bytes'] / gb:>9.2f}")
    lines += ["", "device→host reads (each waits for everything queued): " + (", ".join(bill["reads"]) or "none"),
              "late reads (of an earlier step's values: they wait for that step only): " +
              (", ".join(bill["late_reads"]) or "none")]
    lines += ["", f"{'predicted':<12} {'step ms':>8} {'device busy':>12} {'device idle':>12} {'host issues':>12}"]
    for name, p in bill["predicted"].items():
        lines.append(f"{name:<12} {p['step_ms']:>8.1f} {p['device_busy_ms']:>12.1f} {p['device_idle_ms']:>12.1f} "
                     f"{p['host_ms']:>12.1f}")
    for row in bill["measured"]:
        predicted = bill["predicted"]["h200"]["step_ms"] if "H200" in row["gpu"] else None
        ratio = f", predicted / measured {predicted / row['step_ms']:.2f}" if predicted else ""
        lines.append(f"measured     {row['step_ms']:>8.1f}  {row['gpu']}, commit {row['commit']} ({row['file']}; the "
                     f"engine's step without the loop){ratio}")
    lines.append("not counted: the batch's copy to the GPU (one small copy a step)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
