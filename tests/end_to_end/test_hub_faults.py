"""data=hub over HTTP, through `python -m train`: a Hub on loopback (tests/helpers/hub_server.py) serves 64
parquet files as the dataset repository gpt3d/loopback, and the same files read from a local folder are the
reference: the batches are those of the files, whatever the network does.

- Faults that pass (3 × 429 with Retry-After: 1, 2 × 503, 2 connection resets inside a file, one stall past
  data.read_timeout_s), spread over a 20-step run at dp=2: the run finishes with the losses of the local
  folder's run, bit for bit, each fault one warning and one retry in data/read_retries, and none of
  huggingface_hub's own retry lines.
- An outage from step 8 on (every request answered 503): a checkpoint of the step reached (7 or later), one
  error line naming the Hub and the error, exit code 5, no traceback; the same command once the Hub is back
  finishes on the local folder's losses, bit for bit. Its steps before the outage and after the Hub is back
  are the runs without faults: they too are the local folder's.

Each case runs with data.workers=0 and 2. The outage runs are one process (under a launcher a rank's exit
code 5 comes with the launcher's own traceback), so they have a one-process reference.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cli import metrics, train
from data_corpus import parquet_dataset, short_doc
from hub_server import loopback_hub, outage, reset, server_error, stall, too_many  # noqa: F401 (a fixture)

STEPS = 20
REPO = "gpt3d/loopback"
RETRIES = 3
RUN = [f"train.max_steps={STEPS}", "train.eval_interval=0", "train.checkpoint_interval=5", "logging.wandb.mode=disabled",
       "data=hub", "data.streams=2", "data.shuffle_buffer=2", f"data.read_retries={RETRIES}", "data.read_retry_s=0.05",
       "data.read_timeout_s=3"]
COMPARED = ("step", "tokens", "train/loss", "train/lr", "train/grad_norm", "train/skipped_steps")
WORKERS = [0, 2]


def file(k: int) -> str:
    return f"train-{k:05d}.parquet"


def passing_faults() -> list:
    """Each once, in files of both streams (even files: stream 0, rank 0 at dp=2; odd: stream 1) read from step 1
    to about 14 of the 20 (a file holds three short documents, about a window; a step takes two windows of each
    stream)."""
    return [too_many(file(4)), too_many(file(23)), too_many(file(44)), server_error(file(13), 503),
            server_error(file(50), 503), reset(file(18), at_byte=400), reset(file(35), at_byte=500),
            stall(file(57), at_byte=300, seconds=8)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("loopback")
    parquet_dataset(root, 64, 3, text=short_doc)
    return root


@pytest.fixture(scope="module")
def hub(loopback_hub, folder):
    return loopback_hub(folder, REPO)


@pytest.fixture(scope="module")
def local(tmp_path_factory, folder) -> dict[int, list]:
    """The reference: the same files read from the local folder, at dp=1 and dp=2, by curve."""
    root = tmp_path_factory.mktemp("local")
    train(root / "dp1", None, *RUN, f"data.name={folder}")
    train(root / "dp2", None, *RUN, f"data.name={folder}", kind="ranks", nproc=2)
    return {1: curve(root / "dp1"), 2: curve(root / "dp2")}


def curve(run_dir: Path) -> list[list]:
    return [[row.get(key) for key in COMPARED] for row in metrics(run_dir)]


def hub_run(run_dir: Path, hub, workers: int, **launch):
    return train(run_dir, None, *RUN, f"data.name={REPO}", f"data.workers={workers}", env=hub.env(), **launch)


@pytest.fixture(scope="module", params=WORKERS, ids=lambda w: f"workers{w}")
def passing(request, tmp_path_factory, hub):
    """The faults that pass, at dp=2: the run, its folder and the faults the Hub injected."""
    run_dir = tmp_path_factory.mktemp("passing") / "run"
    hub.inject(*passing_faults())
    proc = hub_run(run_dir, hub, request.param, kind="ranks", nproc=2)
    return proc, run_dir, list(hub.injected)


def test_faults_that_pass_leave_the_losses_of_the_local_folder(passing, local):
    proc, run_dir, injected = passing
    assert len(injected) == len(passing_faults())  # every fault met the run
    assert curve(run_dir) == local[2]


def test_each_fault_that_passes_is_one_warning_and_one_retry(passing, hub):
    proc, run_dir, injected = passing
    assert metrics(run_dir)[-1]["data/read_retries"] == len(injected)  # both ranks' retries
    retries = [line for line in proc.stderr.splitlines() if line.startswith(f"gpt3d: warning: data: {hub.url}/")]
    assert len(retries) == len(injected)
    reasons = sorted(re.search(r"\((.*)\); retry 1 of 3 in ([\d.]+) s$", line).groups() for line in retries)
    assert [why for why, _ in reasons].count("HTTP 429 Too Many Requests") == 3
    assert {wait for why, wait in reasons if why.startswith("HTTP 429")} == {"1"}  # Retry-After, not 0.05 s
    assert [why for why, _ in reasons].count("HTTP 503 Service Unavailable") == 2
    assert sum("Connection reset by peer" in why for why, _ in reasons) == 2
    assert [why for why, _ in reasons if "read_timeout_s" in why] == [
        "nothing received in data.read_timeout_s=3 s, 300 bytes into the body"]
    output = proc.stdout + proc.stderr
    assert "Retrying in" not in output and "thrown while requesting" not in output  # huggingface_hub's own


@pytest.fixture(scope="module", params=WORKERS, ids=lambda w: f"workers{w}")
def outage_and_back(request, tmp_path_factory, hub):
    """One process meets an outage from step 8 on; then the same command with the Hub back."""
    run_dir = tmp_path_factory.mktemp("outage") / "run"
    logged = run_dir / "metrics.jsonl"
    hub.inject(outage(lambda: logged.exists() and len(logged.read_text().splitlines()) >= 7))
    stopped = hub_run(run_dir, hub, request.param, check=False)
    before, latest = curve(run_dir), (run_dir / "checkpoints/latest").read_text().strip()
    hub.lift()
    back = hub_run(run_dir, hub, request.param)
    return stopped, before, latest, back, run_dir


def test_an_outage_saves_the_step_reached_and_stops_with_one_line(outage_and_back, hub):
    stopped, before, latest, _, run_dir = outage_and_back
    assert stopped.returncode == 5, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stdout + stopped.stderr
    (line,) = [line for line in stopped.stderr.splitlines() if line.startswith("gpt3d: error:")]
    step = before[-1][0]
    saved = run_dir / f"checkpoints/step{step:08d}"
    assert 7 <= step < STEPS
    assert re.fullmatch(
        rf"gpt3d: error: data: {re.escape(hub.url)}/datasets/{REPO}/resolve/\w+/train-\d{{5}}\.parquet could not be "
        rf"read \(HTTP 503 Service Unavailable\), also after {RETRIES} retries; stopped after step {step}, checkpoint "
        rf"{re.escape(str(saved))}; once {re.escape(hub.url)} answers again, re-run the same command: it resumes there",
        line)
    assert latest == saved.name


def test_the_same_command_with_the_hub_back_resumes_exactly(outage_and_back, local):
    _, before, _, back, run_dir = outage_and_back
    step = before[-1][0]
    assert f"resumed from {run_dir / 'checkpoints' / f'step{step:08d}'} at step {step}" in back.stdout
    assert curve(run_dir) == local[1]


def test_without_faults_the_hub_gives_the_local_folders_batches(outage_and_back, local):
    """Before the outage and after it, no request failed: those steps are runs without faults."""
    _, before, _, back, run_dir = outage_and_back
    assert before == local[1][: len(before)]
    assert curve(run_dir)[len(before):] == local[1][len(before):]
    assert metrics(run_dir)[-1]["data/read_retries"] == 0 and "gpt3d: warning:" not in back.stderr
