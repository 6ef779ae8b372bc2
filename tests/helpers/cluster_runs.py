"""The local cluster (launch/local_cluster) for the cluster tests: one per pytest worker, and the ways a user
starts the TINY model on it (sbatch launch/slurm.sbatch, launch/torchrun.sh and launch/deepspeed.sh run
inside its nodes), their waits and what they leave behind. Run folders and the corpus live in the cluster's
shared folder, which every node sees; a test's own tmp_path is not shared."""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cli import BIN, REPO, TINY, clean_env, metrics, run_module

# sbatch options every test job takes: no GPUs, one CPU a task (a node of the local cluster has 4)
NO_GPUS = ["--gpus-per-node=0", "--cpus-per-task=1"]
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
               "DEADLINE", "PREEMPTED"}


def bring_up(root: Path, instance: int = 0):
    """A 2-node cluster in `root` on a subnet, controller port and names of this worker's own (`instance`: a
    second one beside the session's); one line on failure."""
    import pytest

    from launch.local_cluster.cluster import ClusterError, up
    from launch.local_cluster.network import subnet_in_use

    pid = os.getpid()
    for i in range(200):
        index = (pid + i) % 200 + 20
        subnet = f"10.231.{index}.0/24"
        try:
            if subnet_in_use(subnet) is None and port_free(17000 + index):
                break
        except (OSError, RuntimeError):  # no `ip`: up() below names what is missing
            break
    try:
        return up(root, nodes=2, subnet=subnet, prefix=f"g3t{pid % 10**5}{instance}", shared=(str(REPO),),
                  ctld_port=17000 + index)
    except ClusterError as error:
        pytest.fail(f"local cluster: {error}", pytrace=False)


def port_free(port: int) -> bool:
    """Nothing listens on `port` here (slurmctld listens on every address of this machine's namespace)."""
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def job_env(cluster, extra: dict | None = None) -> dict:
    """What sbatch exports to a job (--export=ALL): the venv's commands first, the cluster's SLURM config,
    a clean launcher environment."""
    return clean_env({"PATH": f"{BIN}:{os.environ['PATH']}", **cluster.env(), **(extra or {})})


def tiny(corpus: Path, *overrides: str, auto: bool = False) -> list[str]:
    """The TINY run's overrides on `corpus`; `auto`: without the micro batch, which parallel.layout=auto chooses."""
    base = [o for o in TINY if not (auto and o.startswith("train.micro_batch_size="))]
    return [*base, f"data.paths=[{corpus}/*.txt]", "logging.wandb.mode=disabled", *overrides]


def one_process(run_dir: Path, corpus: Path, *overrides: str, auto: bool = False) -> list[dict]:
    """The one-process run of the same settings (forked by this worker's warm interpreter); its metrics."""
    proc = run_module("train", [f"hydra.run.dir={run_dir}", *tiny(corpus, *overrides, auto=auto)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics(run_dir)


def submit(cluster, run_dir: Path, args: list[str], sbatch: tuple[str, ...] = ("--nodes=2",),
           env: dict | None = None) -> int:
    """`sbatch <sbatch> launch/slurm.sbatch <args>` with RUN_DIR=run_dir, its output in <run_dir>.slurm.out;
    the job id."""
    out = Path(f"{run_dir}.slurm.out")
    cmd = ["sbatch", "--parsable", *NO_GPUS, f"--output={out}", *sbatch, str(REPO / "launch" / "slurm.sbatch"), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=job_env(cluster, {"RUN_DIR": str(run_dir), **(env or {})}),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().split(";")[0])


def job(cluster, job_id: int) -> dict[str, str]:
    """`scontrol show job`'s fields of the job (JobState, ExitCode, Restarts, NodeList, NumNodes, …)."""
    out = cluster.slurm("scontrol", "show", "job", "-o", str(job_id))
    return dict(re.findall(r"(\w+)=(\S*)", out))


@dataclass
class Ended:
    state: str
    exit_code: int
    restarts: int
    output: str


def wait_job(cluster, job_id: int, out: Path, timeout: float = 300, completing: bool = False) -> Ended:
    """Until the job has ended; `completing`: or its batch script has, while SLURM still waits for a node that
    died to clean up (a lost node keeps the job COMPLETING until SLURM declares the node down)."""
    deadline = time.monotonic() + timeout
    while True:
        fields = job(cluster, job_id)
        state = fields["JobState"]
        script_done = fields.get("EndTime", "Unknown") != "Unknown"
        if state in DONE_STATES or (completing and state == "COMPLETING" and script_done):
            break
        assert time.monotonic() < deadline, f"job {job_id} still {state} after {timeout} s:\n{read(out)[-3000:]}"
        time.sleep(0.3)
    return Ended(state, int(fields["ExitCode"].split(":")[0]), int(fields["Restarts"]), read(out))


def read(path: Path) -> str:
    return Path(path).read_text() if Path(path).exists() else ""


def rows(run_dir: Path) -> int:
    path = Path(run_dir) / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_rows(run_dir: Path, n: int, timeout: float = 240) -> None:
    """Until metrics.jsonl holds n rows."""
    deadline = time.monotonic() + timeout
    while rows(run_dir) < n:
        assert time.monotonic() < deadline, f"no step {n} in {run_dir} within {timeout} s"
        time.sleep(0.05)


def on_node(cluster, node: str, cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """`cmd` run inside `node` from the repository, in the background, its output in `log`."""
    with open(log, "w") as out:
        return subprocess.Popen(cluster.on_node(node, cmd, wd=REPO), env=job_env(cluster, env), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def node_local_files(cluster, node: str) -> list[str]:
    """What lies in the node's own /tmp (its local disk), but the mount points of shared folders."""
    proc = subprocess.run(cluster.on_node(node, ["find", "/tmp", "-xdev", "-type", "f"], wd="/"), capture_output=True,
                          text=True, timeout=30)
    return proc.stdout.split()


def wait_all(procs: list[subprocess.Popen], logs: list, timeout: float = 300) -> None:
    for proc, log in zip(procs, logs):
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"{log} still running after {timeout} s:\n{read(log)[-3000:]}") from None
        assert code == 0, f"{log} exited {code}:\n{read(log)[-3000:]}"
