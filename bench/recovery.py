"""The recovery paths of `python -m train`, run for real as subprocesses, one PASS/FAIL line per check.

  python -m bench.recovery                        # CUDA when available: gpt3-125m at seq_len 512, bf16
  python -m bench.recovery --device cpu           # a tiny model on the CPU (about a minute)
  python -m bench.recovery --checks kill,sigterm --json recovery.json --run-dir /tmp/recovery
  python -m bench.recovery model.n_layer=6        # overrides for every run, after the device's own

Every run uses `model.deterministic_attention=true`, no evaluation and no sample, and the attention
kernels' committed TABLE configs (GPT3D_TRITON_AUTOTUNE=0, unless the environment sets it): autotuning in each
process could pick other block sizes for the resumed run than for the uninterrupted one, and those
round differently, so the exact checks would compare two kernels; it also spares every process the
tuning. On CUDA (gpt3-125m: about 1.75 GB per checkpoint, three per long run) bench/gpu_suite.sh runs
the checks in two groups, each under its own time limit: `--checks kill,sigterm` (5 processes) and
`--checks nonfinite,ramp,checkpoint` (4). The checks:

  kill        a run with checkpoints is killed with SIGKILL after its first checkpoint (mid-run: fewer
              steps logged than train.max_steps) and started again; its losses and gradient norms, step
              by step, against an uninterrupted run of the same settings (`straight`): the largest
              relative difference must be 0 (the resumed run repeats the lost steps bit for bit).
  sigterm     SIGTERM while a run without scheduled checkpoints is at step ≥ 3: it exits 0 with a
              checkpoint at its last logged step (`latest`), and preempted.json names that step and
              SIGTERM; started again it finishes (exit 0, preempted.json gone) on `straight`'s losses.
  nonfinite   optim.lr=1e6: the weights explode, every step from then on is non-finite and skipped
              (train/skipped_steps counts 1, 2, … in metrics.jsonl, no loss logged for them) and the run
              stops with exit code 1 after train.max_consecutive_skips (3) in a row (docs/faults.md).
  ramp        a batch ramp (start = increment = G/3, over 3·G·seq_len tokens): each step's logged
              train/batch_size is B(τ) = min(G, B₀ + Δ·⌊τ·n/R⌋) at the tokens τ logged before it, the
              tokens grow by that batch, and the ramp reaches G.
  checkpoint  `straight` (train.async_checkpoint=false) against the same run with =true: save throughput
              (the checkpoint folder's bytes / perf/checkpoint_write_s, median over the saves), the pause
              each save cost (perf/checkpoint_pause_s, median over the saves before the last, which waits
              for its write by design) and load throughput (the folder's safetensors files read onto the
              device, timed; they were just written, so mostly from the page cache). Passes when every
              number is positive and the asynchronous pause is shorter than the synchronous one.

Exit code 0 when every check passes, 1 otherwise. --json writes the records ({check, ok, numbers,
device, commit}); --run-dir keeps the run folders (default: a temporary folder, removed at the end).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
COMMON = ["model.deterministic_attention=true", "train.eval_interval=0", "train.sample_tokens=0",
          "logging.log_interval=1", "logging.wandb.mode=disabled", "train.keep_checkpoints=2"]
# Per device: the model and batch of every run, and the steps and checkpoint interval of the long runs.
SETTINGS = {
    "cpu": {"overrides": ["train.device=cpu", "model=toy", "model.n_layer=2", "model.n_head=2", "model.d_model=32",
                          "model.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=2"],
            "steps": 24, "interval": 4, "ramp_batch": 12},
    "cuda": {"overrides": ["train.device=cuda", "model=gpt3-125m", "model.seq_len=512", "train.global_batch_size=8",
                           "train.micro_batch_size=8"],
             "steps": 24, "interval": 8, "ramp_batch": 24},  # 3 checkpoints a run: 2 pauses before the last
}
MAX_SKIPS = 3
RUN_TIMEOUT_S = 600


class Runs:
    """Starts `python -m train` runs in folders under `root`, each with the device's settings, then the
    run's own overrides, then the user's; each run's output goes to <root>/<name>.log."""

    def __init__(self, root: Path, device: str, user_overrides: list[str]):
        self.root, self.device = root, device
        self.base = [*COMMON, *SETTINGS[device]["overrides"], "train.max_steps=" + str(SETTINGS[device]["steps"])]
        self.user = user_overrides
        self.started: list[subprocess.Popen] = []  # every run, so that none outlives an interrupted benchmark
        self.straight_rc: int | None = None  # the exit code of `straight` once it ran (function straight)
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        self.env.update(WANDB_SILENT="true", PYTHONUNBUFFERED="1")
        self.env.setdefault("GPT3D_TRITON_AUTOTUNE", "0")  # the same kernel configs in every run (module docstring)
        if device == "cpu":
            self.env.setdefault("OMP_NUM_THREADS", "1")  # a tiny model: more threads only cost

    def folder(self, name: str) -> Path:
        return self.root / name

    def command(self, name: str, overrides: list[str]) -> list[str]:
        return [sys.executable, "-m", "train", f"hydra.run.dir={self.folder(name)}", *self.base, *overrides, *self.user]

    def start(self, name: str, overrides: list[str]) -> subprocess.Popen:
        """In a session of its own, so that a signal reaches the run and nothing else."""
        with open(self.root / f"{name}.log", "a") as log:
            proc = subprocess.Popen(self.command(name, overrides), cwd=REPO, env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        """SIGKILL every run still going (its session: the run and anything it started)."""
        for proc in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def run(self, name: str, overrides: list[str]) -> int:
        proc = self.start(name, overrides)
        try:
            return proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return -int(signal.SIGKILL)

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text()

    def records(self, name: str) -> list[dict]:
        """The complete lines of the run's metrics.jsonl (not one it is still writing)."""
        path = self.folder(name) / "metrics.jsonl"
        lines = path.read_text().split("\n")[:-1] if path.exists() else []
        return [json.loads(line) for line in lines if line]

    def latest_step(self, name: str) -> int | None:
        latest = self.folder(name) / "checkpoints" / "latest"
        return int(latest.read_text().strip().removeprefix("step")) if latest.is_file() else None


def wait_for(condition, proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> bool:
    """Poll `condition` every 10 ms while `proc` runs; whether it came true."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return bool(condition())


def max_relative_difference(got: list[dict], expected: list[dict], keys=("train/loss", "train/grad_norm")) -> float:
    """max |got − expected| / |expected| over every step and key (inf when the steps differ)."""
    if [r["step"] for r in got] != [r["step"] for r in expected]:
        return math.inf
    worst = 0.0
    for g, e in zip(got, expected):
        for key in keys:
            a, b = g[key], e[key]
            if a is None or b is None:
                return math.inf
            worst = max(worst, abs(a - b) / abs(b) if b else abs(a))
    return worst


def check_kill(runs: Runs) -> dict:
    steps, interval = SETTINGS[runs.device]["steps"], SETTINGS[runs.device]["interval"]
    schedule = [f"train.checkpoint_interval={interval}"]
    straight_rc = straight(runs)
    proc = runs.start("killed", schedule)
    had_checkpoint = wait_for(lambda: runs.latest_step("killed") is not None, proc)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    killed_rc = proc.wait()
    logged_at_kill = len(runs.records("killed"))
    resumed_from = runs.latest_step("killed")
    resumed_rc = runs.run("killed", schedule)
    diff = max_relative_difference(runs.records("killed"), runs.records("straight"))
    numbers = {"killed_exit": killed_rc, "steps_logged_at_kill": logged_at_kill, "resumed_from_step": resumed_from,
               "max_steps": steps, "resumed_exit": resumed_rc, "straight_exit": straight_rc, "max_rel_diff": diff}
    ok = (had_checkpoint and killed_rc == -signal.SIGKILL and logged_at_kill < steps and resumed_rc == 0
          and straight_rc == 0 and diff == 0.0)
    return {"check": "kill", "ok": ok, "numbers": numbers}


def straight(runs: Runs) -> int:
    """The uninterrupted run with synchronous checkpoints (`straight`), once for every check that uses it."""
    if runs.straight_rc is not None:
        return runs.straight_rc
    interval = SETTINGS[runs.device]["interval"]
    runs.straight_rc = runs.run("straight", [f"train.checkpoint_interval={interval}", "train.async_checkpoint=false"])
    return runs.straight_rc


def check_sigterm(runs: Runs) -> dict:
    steps = SETTINGS[runs.device]["steps"]
    schedule = ["train.checkpoint_interval=0"]  # the only checkpoint before the end is the one the signal asks for
    proc = runs.start("sigterm", schedule)
    reached = wait_for(lambda: len(runs.records("sigterm")) >= 3, proc)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
    try:
        stopped_rc = proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stopped_rc = proc.wait()
    marker_path = runs.folder("sigterm") / "preempted.json"
    marker = json.loads(marker_path.read_text()) if marker_path.is_file() else {}
    logged = runs.records("sigterm")
    last_logged = logged[-1]["step"] if logged else None
    saved = runs.latest_step("sigterm")
    resumed_rc = runs.run("sigterm", schedule)
    straight_rc = straight(runs)
    resumed = runs.records("sigterm")
    diff = max_relative_difference(resumed, runs.records("straight"))
    numbers = {"stopped_exit": stopped_rc, "last_logged_step": last_logged, "checkpoint_step": saved,
               "marker_step": marker.get("step"), "marker_signal": marker.get("signal"), "resumed_exit": resumed_rc,
               "resumed_last_step": resumed[-1]["step"] if resumed else None, "max_steps": steps,
               "marker_left": marker_path.exists(), "max_rel_diff_vs_straight": diff}
    ok = (reached and stopped_rc == 0 and last_logged is not None and last_logged < steps
          and saved == last_logged == marker.get("step") and marker.get("signal") == "SIGTERM"
          and resumed_rc == 0 and numbers["resumed_last_step"] == steps and not marker_path.exists()
          and straight_rc == 0 and diff == 0.0)
    return {"check": "sigterm", "ok": ok, "numbers": numbers}


def check_nonfinite(runs: Runs) -> dict:
    rc = runs.run("nonfinite",
                  ["optim.lr=1e6", f"train.max_consecutive_skips={MAX_SKIPS}", "train.checkpoint_interval=0"])
    rows = runs.records("nonfinite")
    counts = [r["train/skipped_steps"] for r in rows]
    first = next((r["step"] for r in rows if r["train/skipped_steps"]), None)
    skipped_rows = [r for r in rows if first is not None and r["step"] >= first]
    numbers = {"exit": rc, "first_skipped_step": first, "skipped_steps": counts[-1] if counts else 0,
               "last_step": rows[-1]["step"] if rows else None, "max_consecutive_skips": MAX_SKIPS}
    ok = (rc == 1 and first is not None and first >= 2
          and [r["train/skipped_steps"] for r in skipped_rows] == list(range(1, MAX_SKIPS + 1))
          and all(r["train/loss"] is None for r in skipped_rows)
          and all(r["train/loss"] is not None and math.isfinite(r["train/loss"]) for r in rows[: first - 1])
          and f"train.max_consecutive_skips={MAX_SKIPS}" in runs.log("nonfinite"))
    return {"check": "nonfinite", "ok": ok, "numbers": numbers}


def check_ramp(runs: Runs) -> dict:
    full = SETTINGS[runs.device]["ramp_batch"]
    start = full // 3
    seq_len = int([o for o in runs.base + runs.user if o.startswith("model.seq_len=")][-1].split("=")[1])
    ramp_tokens = 3 * full * seq_len
    rc = runs.run("ramp", [f"train.global_batch_size={full}", f"train.batch_ramp.start={start}",
                           f"train.batch_ramp.increment={start}", f"train.batch_ramp.tokens={ramp_tokens}",
                           "train.max_steps=8", "train.checkpoint_interval=0"])
    rows = runs.records("ramp")
    increments = (full - start) // start
    expected, tokens = [], 0
    for r in rows:
        expected.append(min(full, start + start * (tokens * increments // ramp_tokens)))
        tokens += expected[-1] * seq_len
    logged = [r["train/batch_size"] for r in rows]
    logged_tokens = [r["tokens"] for r in rows]
    expected_tokens = [seq_len * sum(expected[: i + 1]) for i in range(len(expected))]
    numbers = {"exit": rc, "batch_sizes": logged, "expected": expected, "tokens": logged_tokens}
    ok = rc == 0 and len(rows) == 8 and logged == expected and logged_tokens == expected_tokens and logged[-1] == full
    return {"check": "ramp", "ok": ok, "numbers": numbers}


def check_checkpoint(runs: Runs) -> dict:
    interval = SETTINGS[runs.device]["interval"]
    sync_rc = straight(runs)
    async_rc = runs.run("async", [f"train.checkpoint_interval={interval}", "train.async_checkpoint=true"])
    numbers = {"sync_exit": sync_rc, "async_exit": async_rc}
    for name, label in (("straight", "sync"), ("async", "async")):
        rows = runs.records(name)
        saves = [r for r in rows if r.get("perf/checkpoint_write_s") is not None]
        pauses = [r["perf/checkpoint_pause_s"] for r in rows[:-1] if r.get("perf/checkpoint_pause_s") is not None]
        step = runs.latest_step(name)
        size = folder_bytes(runs.folder(name) / "checkpoints" / f"step{step:08d}") if step else 0
        write_s = statistics.median(r["perf/checkpoint_write_s"] for r in saves) if saves else math.nan
        numbers[f"{label}_saves"] = len(saves)
        numbers[f"{label}_checkpoint_gb"] = size / 1e9
        numbers[f"{label}_save_gb_per_s"] = size / 1e9 / write_s if saves and write_s > 0 else math.nan
        numbers[f"{label}_pause_s"] = statistics.median(pauses) if pauses else math.nan
    step = runs.latest_step("straight")
    if step:
        gb, seconds = timed_load(runs.folder("straight") / "checkpoints" / f"step{step:08d}", runs.device)
        numbers["load_gb_per_s"] = gb / seconds
    positive = all(v > 0 for k, v in numbers.items() if not k.endswith("_exit"))  # nan compares False
    ok = (sync_rc == 0 and async_rc == 0 and positive and "load_gb_per_s" in numbers
          and numbers["async_pause_s"] < numbers["sync_pause_s"])
    return {"check": "checkpoint", "ok": ok, "numbers": numbers}


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def timed_load(folder: Path, device: str) -> tuple[float, float]:
    """Read every safetensors file of a checkpoint folder onto `device`: (GB read, seconds)."""
    from safetensors.torch import load_file

    files = sorted(folder.rglob("*.safetensors"))
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    for file in files:
        load_file(file, device=device)
    synchronize()
    return sum(f.stat().st_size for f in files) / 1e9, time.perf_counter() - start


CHECK_FUNCTIONS = {"kill": check_kill, "sigterm": check_sigterm, "nonfinite": check_nonfinite, "ramp": check_ramp,
                   "checkpoint": check_checkpoint}


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO).returncode != 0
    return head + (" (with uncommitted changes)" if dirty else "")


def finite_or_null(value):
    """The records with every nan or inf (a number not measured, steps that did not match) as null, for JSON."""
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_null(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def format_numbers(numbers: dict) -> str:
    def show(value):
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    return ", ".join(f"{k}={show(v)}" for k, v in numbers.items())


def run_checks(runs: Runs, checks: list[str], kept: bool, json_path: Path | None) -> list[dict]:
    """Each check in turn, its record printed as it ends and the records so far written to `json_path`
    (temporary name, then renamed: an interrupted benchmark leaves the checks it finished)."""
    records = []
    for name in checks:
        started = time.monotonic()
        record = CHECK_FUNCTIONS[name](runs)
        record.update(device=runs.device, commit=commit(), seconds=round(time.monotonic() - started, 1))
        records.append(record)
        print(f"{'PASS' if record['ok'] else 'FAIL'} {name} ({record['seconds']} s): "
              f"{format_numbers(record['numbers'])}", flush=True)
        if not record["ok"]:
            print(f"  logs: {runs.root}/*.log" + ("" if kept else " (removed at the end; keep them with --run-dir)"),
                  flush=True)
        if json_path:
            tmp = json_path.with_name(json_path.name + ".tmp")
            tmp.write_text(json.dumps(finite_or_null(records), indent=1) + "\n")
            tmp.replace(json_path)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="training overrides for every run, after the device's own")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available, else cpu")
    parser.add_argument("--checks", default=",".join(CHECK_FUNCTIONS),
                        help=f"comma-separated, of {', '.join(CHECK_FUNCTIONS)} (default all)")
    parser.add_argument("--json", type=Path, help="also write the records as JSON to this file")
    parser.add_argument("--run-dir", type=Path, help="keep the run folders here (default: a temporary folder)")
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    checks = [c for c in args.checks.split(",") if c]
    unknown = [c for c in checks if c not in CHECK_FUNCTIONS]
    if unknown or not checks:
        parser.error(f"--checks {args.checks!r}: unknown {', '.join(unknown) or '(none given)'}; "
                     f"valid: {', '.join(CHECK_FUNCTIONS)}")

    with tempfile.TemporaryDirectory(prefix="recovery-") as scratch:
        root = args.run_dir or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        runs = Runs(root, device, args.overrides)
        print(f"recovery checks on {device}, runs in {root}: python -m train {' '.join(runs.base + runs.user)}",
              flush=True)
        try:
            records = run_checks(runs, checks, kept=args.run_dir is not None, json_path=args.json)
        finally:  # Ctrl-C or a time limit's SIGINT: no run left behind on the device
            runs.stop_all()
    sys.exit(0 if all(r["ok"] for r in records) else 1)


if __name__ == "__main__":
    main()
