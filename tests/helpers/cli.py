"""Running `python -m train` the way users do (plain, torchrun, deepspeed launcher), for tests."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# A tiny GPT-3-shaped model on a corpus of real text; every layout test uses these settings.
TINY = [
    "model.n_layer=3", "model.n_head=2", "model.d_model=32", "model.seq_len=32",
    "train.global_batch_size=4", "train.micro_batch_size=1", "train.eval_batches=1",
    "logging.log_interval=1", "train.sample_tokens=0", "data=files", "data.val_permille=250",
    "optim.warmup_tokens=32", "optim.decay_tokens=2000", "optim.lr=3e-3",
    "logging.curves=false",  # (drawn by the tests of curves only)
]


def write_corpus(folder: Path) -> Path:
    """A few dozen real documents: the source of standard-library functions, one .txt file each."""
    import argparse  # noqa: E401
    import csv
    import json as js
    import logging
    import pathlib
    import string
    import textwrap

    for module in (argparse, csv, js, logging, pathlib, string, textwrap):
        for name, obj in inspect.getmembers(module, inspect.isfunction):
            if obj.__module__ == module.__name__:
                (folder / f"{module.__name__}.{name}.txt").write_text(inspect.getsource(obj))
    return folder


def launcher(kind: str, nproc: int, module: str = "train") -> list[str]:
    """The command prefix that starts `nproc` ranks of `-m <module>` (`python`: one process, forked by this
    worker's warm interpreter; `process`: one fresh interpreter, which pays every import itself, for what
    happens at start-up; `torchrun`, `deepspeed`: the launchers; `ranks`: the ranks forked by the warm
    interpreter as a launcher starts them, shown as torchrun would take them)."""
    if kind in ("python", "process"):
        return [sys.executable, "-m", module]
    if kind in ("torchrun", "ranks"):
        return [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()), "-m", module]
    if kind == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), "--module", module]
    raise ValueError(kind)


def arguments(run_dir: Path, corpus: Path | None, *overrides: str) -> list[str]:
    """The overrides of a TINY run in run_dir on the corpus (None: the overrides choose the data)."""
    data = [f"data.paths=[{corpus}/*.txt]"] if corpus is not None else []
    return [f"hydra.run.dir={run_dir}", *TINY, *data, *overrides]


def run_module(module: str, args: list[str], kind: str = "python", nproc: int = 1, env: dict | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` started by `kind` (see `launcher`), in the repository, with `env` (default:
    clean_env()); its exit code and output. `python` and `ranks` fork from the warm interpreter
    (tests/helpers/warm.py): the same module run as `__main__`, without paying its imports again; `process`,
    `torchrun` and `deepspeed` start fresh interpreters."""
    env = clean_env() if env is None else env
    cmd = [*launcher(kind, nproc, module), *args]
    if kind not in ("python", "ranks"):
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    from warm import Warm

    warm = Warm.shared()
    with tempfile.TemporaryDirectory(prefix="gpt3d-cmd-") as folder:
        out, err = Path(folder) / "out", Path(folder) / "err"
        ranks = nproc if kind == "ranks" else 0
        child = warm.start([module, *args], env, REPO, out, err, ranks=ranks, port=free_port() if ranks else None)
        codes = warm.wait(child, timeout)
        stdout, stderr = out.read_text() if out.exists() else "", err.read_text() if err.exists() else ""
    if codes is None:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    failed = [code for code in codes if code != 0]
    return subprocess.CompletedProcess(cmd, failed[0] if failed else 0, stdout, stderr)


def train(
    run_dir: Path, corpus: Path | None, *overrides: str, kind: str = "python", nproc: int = 1, check: bool = True,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    proc = run_module("train", arguments(run_dir, corpus, *overrides), kind, nproc, clean_env(env or {}))
    if check:
        assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


class Forked:
    """A command the warm interpreter forked and left running (`start_forked`): what subprocess.Popen offers, for
    all of its processes (one, or each rank of a launch) at once. Each process is in a session of its own, whose
    id is its pid (`pids`; `pid`: the first)."""

    def __init__(self, warm, child, cmd: list[str]):
        self.warm, self.child, self.args = warm, child, cmd
        self.pids = list(child.pids)
        self.pid = self.pids[0]
        self._codes: list[int] | None = None

    def codes(self) -> list[int | None]:
        """Each process's exit code (negative: the signal that ended it), None while it runs."""
        return list(self._codes) if self._codes is not None else self.warm.exit_codes(self.child)

    def poll(self) -> int | None:
        """None while any process runs; then the first nonzero exit code, or 0."""
        codes = self.codes()
        return None if None in codes else next((code for code in codes if code), 0)

    def kill(self) -> None:
        """SIGKILL to every process still running, and to whatever it started (its session)."""
        for pid, code in zip(self.pids, self.codes()):
            if code is None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def wait_codes(self, timeout: float = 600) -> list[int]:
        """Each process's exit code, once all have ended (after `timeout`: every one killed, TimeoutExpired)."""
        if self._codes is None:
            codes = self.warm.wait(self.child, timeout)
            if codes is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._codes = codes
        return list(self._codes)

    def wait(self, timeout: float = 600) -> int:
        codes = self.wait_codes(timeout)
        return next((code for code in codes if code), 0)


def start_forked(module: str, args: list[str], out: Path | str, err: Path | str | None = None, ranks: int = 0,
                 env: dict | None = None) -> Forked:
    """`python -m <module> <args>` forked by the warm interpreter as `run_module` forks it (`ranks`: that many
    ranks of a launch, each with the launcher's environment), left running in the background: its stdout to
    `out`, its stderr to `err` (default: `out` too); with ranks, "{rank}" in either path is each rank's number."""
    from warm import Warm

    warm = Warm.shared()
    child = warm.start([module, *args], clean_env(env), REPO, Path(out), Path(err or out), ranks=ranks,
                       port=free_port() if ranks else None)
    return Forked(warm, child, [*launcher("ranks" if ranks else "python", ranks or 1, module), *args])


def start_train(run_dir: Path, corpus: Path | None, *overrides: str, log: Path) -> Forked:
    """One-process `python -m train` as `train` runs it (forked by the warm interpreter), in the background,
    writing its output to `log`, in a session of its own: the session id is its pid, so a test can find and stop
    whatever it started."""
    Path(log).write_text("")
    return start_forked("train", arguments(run_dir, corpus, *overrides), log)


def kill_after_first_checkpoint(proc: Forked, run_dir: Path, log: Path) -> int:
    """Wait (up to 300 s) until the background run `proc` (start_train) has a checkpoint, then SIGKILL it,
    no chance to clean up; returns the step its `latest` names."""
    latest, deadline = Path(run_dir) / "checkpoints" / "latest", time.monotonic() + 300
    while not latest.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert latest.is_file(), Path(log).read_text()[-3000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return int(latest.read_text().strip().removeprefix("step"))


def generate(
    checkpoint: Path, *overrides: str, kind: str = "python", nproc: int = 1, check: bool = True
) -> subprocess.CompletedProcess:
    """`python -m train.generate` on a run's checkpoint (which gives the model)."""
    proc = run_module("train.generate", [f"generate.checkpoint={checkpoint}", *overrides], kind, nproc)
    if check:
        assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def start(log: Path, cmd: list[str], env: dict | None = None, **popen) -> subprocess.Popen:
    """Start `cmd` in the repository without waiting; its stdout and stderr go to <log>.out and <log>.err
    (files, not pipes: nothing blocks however much it prints). `read_log(log)` gives them back."""
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        return subprocess.Popen(cmd, cwd=REPO, env=clean_env(env), stdout=out, stderr=err, text=True, **popen)


def read_log(log: Path) -> tuple[str, str]:
    return Path(f"{log}.out").read_text(), Path(f"{log}.err").read_text()


def clean_env(extra: dict | None = None) -> dict:
    """This environment without any launcher variables, quiet W&B, unbuffered output, one thread."""
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    clean.update({"WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}, **(extra or {}))
    return clean


def assert_refused_before_building(run_dir: Path, corpus: Path, world: int, overrides, message: str) -> None:
    """`python -m train` as a launcher would start rank 0 of `world` processes, refused before rendezvous: exit 2,
    `message` on stderr, no traceback and no run folder."""
    proc = train(run_dir, corpus, *overrides, check=False, env={"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and not run_dir.exists()


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# How close a layout's run must follow the one-process run of the same precision, per step: the loss
# and the gradient norm relative, the learning rate to 1e-12.
#   fp32  layouts change only the order of fp32 sums: 1e-5 for the loss, 1e-4 for the norm
#   bf16  bf16 keeps 8 significant bits (unit roundoff u = 2^-8 ≈ 3.9e-3), and a layout changes where
#         partial sums are rounded to bf16 (tensor-parallel partial products, all-reduces, pipeline
#         boundaries): the loss, an fp32 mean over tokens of those rounded values, within one rounding
#         of itself (u); the gradient norm within 1% (≈ 2.6 u: it sums the squares of rounded gradients)
BF16_UNIT_ROUNDOFF = 2.0**-8
TOLERANCES = {"fp32": (1e-5, 1e-4), "bf16": (BF16_UNIT_ROUNDOFF, 0.01)}


def assert_same_losses(got: list[dict], expected: list[dict], precision: str = "fp32") -> None:
    """Two runs' metrics records on one loss curve: the same steps, losses and gradient norms within
    TOLERANCES[precision], learning rates equal."""
    loss_rel, norm_rel = TOLERANCES[precision]
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for g, e in zip(got, expected):
        assert g["train/loss"] == pytest.approx(e["train/loss"], rel=loss_rel), f"step {e['step']}"
        assert g["train/grad_norm"] == pytest.approx(e["train/grad_norm"], rel=norm_rel), f"step {e['step']}"
        assert g["train/lr"] == pytest.approx(e["train/lr"], rel=1e-12)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def evaluate(
    checkpoint: Path, *overrides: str, kind: str = "python", nproc: int = 1, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -m train.evaluate` on a run's checkpoint, with the TINY model (`env`: variables to set; an empty
    value removes one)."""
    model = [o for o in TINY if o.startswith("model.")]
    variables = {key: value for key, value in clean_env(env).items() if value != ""}
    proc = run_module("train.evaluate", [*model, f"evaluate.checkpoint={checkpoint}", *overrides], kind, nproc,
                      variables)
    if check:
        assert proc.returncode == 0, f"{' '.join(proc.args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc
