"""Seconds from a node's death to the first training step after the run came back, per launcher, on the local
cluster (launch/local_cluster: two nodes of network namespaces on this machine; needs root).

  python -m bench.cluster_recovery                          # SLURM and torchrun, once each
  python -m bench.cluster_recovery --launchers slurm --repeats 3 --json r.json --markdown r.md
  python -m bench.cluster_recovery train.peer_timeout_s=10  # overrides for every run, after the bench's own

Each repeat trains the toy (3 layers, d_model 32, seq_len 32) on both nodes with the settings docs/cluster.md
recommends for a run that must survive a node: parallel.layout=auto, one restart allowed, a checkpoint every 10
steps, train.peer_timeout_s at its default. After step 14 node2 dies (its link down, then every process in it
SIGKILLed) and the bench reads the run's output as it grows, timing from the kill:

  detected   a rank says its peer sent no heartbeat (train/guard/peers.py): the live ranks exit
  started    the new start's first line (its layout): the launcher started the ranks again, they imported
             torch, DeepSpeed and gpt3d and chose a layout for the ranks left
  resumed    "resumed from ... at step N": the new ranks built the model and loaded the checkpoint
  stepped    the first step after the resume has its line: the run is training again

  slurm      sbatch --nodes=1-2 launch/slurm.sbatch with MAX_RESTARTS=1 (ranks restarted inside the job)
  torchrun   launch/torchrun.sh on each node, NNODES=1:2 MAX_RESTARTS=1 (c10d rendezvous on node1)

The run must then finish (exit 0) with a loss at its last step; the records carry the phases, the device
(this machine's CPU), the date, the commit and the command. --markdown writes the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch.local_cluster.cluster import Cluster, ClusterError, up

REPO = Path(__file__).resolve().parents[1]
TOY = ["model.n_layer=3", "model.n_head=2", "model.d_model=32", "model.seq_len=32", "train.global_batch_size=4",
       "train.eval_batches=1", "logging.log_interval=1", "train.sample_tokens=0", "data=files",
       "data.val_permille=250", "optim.warmup_tokens=32", "optim.decay_tokens=2000", "optim.lr=3e-3",
       "logging.curves=false", "logging.wandb.mode=disabled", "train.max_steps=40", "train.checkpoint_interval=10",
       "parallel.layout=auto"]
KILL_AFTER_STEP = 14
PHASES = {  # phase: the pattern whose first appearance after the kill ends it
    "detected": r"sent no heartbeat|has not answered",
    "started": r"layout auto for \d+ process",
    "resumed": r"resumed from \S+ at step (\d+)",
}
TIMEOUT_S = 300


def write_corpus(folder: Path) -> Path:
    """Real text the ranks read from the shared folder: the source of a few standard-library modules."""
    import inspect
    import json as js
    import textwrap

    folder.mkdir(parents=True, exist_ok=True)
    for module in (js, textwrap, inspect):
        (folder / f"{module.__name__}.txt").write_text(inspect.getsource(module))
    return folder


def environment(cluster: Cluster, extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **cluster.env(), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", **extra}


def start_slurm(cluster: Cluster, run_dir: Path, args: list[str]) -> tuple[list[Path], callable]:
    out = Path(f"{run_dir}.out")
    cmd = ["sbatch", "--parsable", "--nodes=1-2", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={out}",
           str(REPO / "launch" / "slurm.sbatch"), *args]
    job = subprocess.run(cmd, cwd=REPO, env=environment(cluster, {"RUN_DIR": str(run_dir), "MAX_RESTARTS": "1"}),
                         capture_output=True, text=True, check=True).stdout.strip()

    def ended() -> int | None:
        fields = dict(re.findall(r"(\w+)=(\S*)", cluster.slurm("scontrol", "show", "job", "-o", job)))
        if fields["JobState"] in ("PENDING", "RUNNING", "CONFIGURING") or fields.get("EndTime") == "Unknown":
            return None
        return int(fields["ExitCode"].split(":")[0])

    return [out], ended


def start_torchrun(cluster: Cluster, run_dir: Path, args: list[str]) -> tuple[list[Path], callable]:
    env = {"NNODES": "1:2", "MAX_RESTARTS": "1", "MASTER_ADDR": "node1", "MASTER_PORT": "29530",
           "GPT3D_RUN_STAMP": run_dir.name, "RUN_DIR": str(run_dir)}
    logs, procs = [], []
    for node in cluster.nodes:
        log = Path(f"{run_dir}.{node}.out")
        with open(log, "w") as file:
            procs.append(subprocess.Popen(cluster.on_node(node, ["launch/torchrun.sh", *args], wd=REPO),
                                          env=environment(cluster, env), stdout=file, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        logs.append(log)
    return logs[:1], lambda: procs[0].poll()


LAUNCHERS = {"slurm": start_slurm, "torchrun": start_torchrun}


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def one_repeat(cluster: Cluster, launcher: str, run_dir: Path, overrides: list[str]) -> dict:
    corpus = write_corpus(cluster.root / "shared" / "bench-corpus")
    args = [*TOY, f"data.paths=[{corpus}/*.txt]", *overrides]
    cluster.wait_idle()  # both nodes free: a node range starts on the nodes free at the time
    logs, ended = LAUNCHERS[launcher](cluster, run_dir, args)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while steps_logged(run_dir) < KILL_AFTER_STEP:
            if ended() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{launcher}: no step {KILL_AFTER_STEP}; see {logs[0]}")
            time.sleep(0.05)
        before = logs[0].read_text()
        killed = time.monotonic()
        cluster.kill_node("node2")
        seen: dict[str, float] = {}
        resumed_step = None
        while True:
            code = ended()
            text = logs[0].read_text()[len(before):]
            now = time.monotonic() - killed
            for phase, pattern in PHASES.items():
                if phase not in seen and (match := re.search(pattern, text)):
                    seen[phase] = now
                    if phase == "resumed":
                        resumed_step = int(match[1])
            if resumed_step is not None and "stepped" not in seen and re.search(
                    rf"step +{resumed_step + 1}/", text.split("resumed from", 1)[1]):
                seen["stepped"] = now
            if code is not None or now > TIMEOUT_S:
                break
            time.sleep(0.05)
        while (code := ended()) is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        if "node2/holder" not in cluster.pids:  # killed: bring it back for the next repeat
            cluster.revive("node2")
    missing = [p for p in (*PHASES, "stepped") if p not in seen]
    if missing or code != 0:
        tail = "\n".join(logs[0].read_text().splitlines()[-40:])
        raise RuntimeError(f"{launcher}: exit {code}, phases not seen: {missing}; the end of {logs[0]}:\n{tail}")
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    return {"launcher": launcher, "seconds": {p: round(seen[p], 2) for p in (*PHASES, "stepped")},
            "resumed_step": resumed_step, "killed_after_step": KILL_AFTER_STEP, "final_step": last["step"],
            "final_loss": last["train/loss"]}


def commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def markdown(records: list[dict], meta: dict) -> str:
    lines = [f"# Recovery from a lost node, local cluster ({meta['device']})", "",
             f"{meta['date']}, commit {meta['commit']}: `{meta['command']}`", "",
             "Seconds from the kill (node2's link down, its processes SIGKILLed) to each phase; median of "
             f"{meta['repeats']} repeat(s), range in brackets.", "",
             "| launcher | detected | started again | resumed | first step after resume |", "|---|---|---|---|---|"]
    for launcher in dict.fromkeys(r["launcher"] for r in records):
        rows = [r["seconds"] for r in records if r["launcher"] == launcher]
        cells = []
        for phase in (*PHASES, "stepped"):
            values = [r[phase] for r in rows]
            cells.append(f"{statistics.median(values):.1f}" + (f" [{min(values):.1f}–{max(values):.1f}]"
                                                              if len(values) > 1 else ""))
        lines.append(f"| {launcher} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster_recovery", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launchers", default="slurm,torchrun", help="comma-separated: " + ", ".join(LAUNCHERS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args(argv)
    launchers = args.launchers.split(",")
    if bad := [name for name in launchers if name not in LAUNCHERS]:
        parser.error(f"unknown launcher(s) {', '.join(bad)}; valid: {', '.join(LAUNCHERS)}")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    root = Path(tempfile.mkdtemp(prefix="gpt3d-recovery-"))
    try:
        cluster = up(root, nodes=2, subnet="10.232.0.0/24", prefix="g3bench", shared=(str(REPO),), ctld_port=17800)
    except ClusterError as error:
        print(f"bench.cluster_recovery: {error}", file=sys.stderr)
        return 2
    records = []
    try:
        for launcher in launchers:
            for i in range(args.repeats):
                record = one_repeat(cluster, launcher, root / "shared" / f"{launcher}-{i}", args.overrides)
                print(f"{launcher} #{i + 1}: " + ", ".join(f"{k} {v:.1f} s" for k, v in record["seconds"].items()),
                      flush=True)
                records.append(record)
    finally:
        cluster.down()
        shutil.rmtree(root, ignore_errors=True)
    meta = {"device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (CPU ranks)",
            "date": datetime.date.today().isoformat(), "commit": commit(), "repeats": args.repeats,
            "command": "python -m bench.cluster_recovery " + " ".join(argv if argv is not None else sys.argv[1:])}
    table = markdown(records, meta)
    print(table)
    if args.json:
        args.json.write_text(json.dumps({**meta, "records": records}, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
