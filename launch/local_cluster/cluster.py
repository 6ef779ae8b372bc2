"""A SLURM cluster of network namespaces on one Linux machine: bring it up, reach its nodes, fail them, take
it down. Needs root (namespaces, a bridge, daemons as root) and Debian's slurm-wlm, munge, openssh-server and
pdsh (`install` adds what is missing with apt-get).

A node is a long-lived holder process (`sleep`) in a network namespace of its own (an address on the
cluster's bridge), a UTS namespace (its hostname) and a mount namespace: a private tmpfs on /tmp (the node's
local disk), the cluster's hosts file on /etc/hosts, its ssh folder (keys, and every node's name) on ~/.ssh,
and the shared folders bound back in, so that every node sees them as a cluster sees its shared filesystem.
Its daemons (`slurmd -N <node>`, `sshd`) and everything they start enter those namespaces through `nsenter`.
The controller (`slurmctld`) and munge run in this machine's own network namespace, on the bridge's address;
munge's socket is a file in the cluster's folder, which every node reaches.

Everything the cluster started is recorded by PID in <root>/cluster.json; `down` ends those processes and
every process left inside a node's namespace, by PID, then removes the namespaces and the bridge.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from launch.local_cluster import files, network

PACKAGES = {"slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "munged": "munge", "sshd": "openssh-server",
            "pdsh": "pdsh", "nsenter": "util-linux", "ip": "iproute2"}
SBIN = ("/usr/sbin", "/sbin")
UNIX_SOCKET_MAX = 107  # sun_path holds 108 bytes with its terminating zero

HOLDER = r"""set -e
hostname "$1"
root="$2"; shift 2
exec 3</tmp
mount -t tmpfs -o mode=1777,size=1g gpt3d-node-local /tmp
for path in "$@"; do
  case "$path" in /tmp/*) mkdir -p "$path"; mount --no-canonicalize --bind "/proc/self/fd/3/${path#/tmp/}" "$path" ;; esac
done
exec 3<&-
mount --bind "$root/hosts" /etc/hosts
home="$(getent passwd "$(id -u)" | cut -d: -f6)"
mkdir -p -m 700 "$home/.ssh"  # the mount point, made empty where there was none, and left (other clusters use it)
mount --bind "$root/ssh" "$home/.ssh"
mkdir -p /run/sshd
echo $$ > "$root/run/holder.$(hostname)"
exec sleep infinity
"""


class ClusterError(RuntimeError):
    """The cluster cannot be brought up or used here; the message says why in one line."""


def find(program: str) -> str | None:
    here = (f"{d}/{program}" for d in SBIN if os.access(f"{d}/{program}", os.X_OK))
    return shutil.which(program) or next(here, None)


def missing_packages() -> list[str]:
    return sorted({package for program, package in PACKAGES.items() if find(program) is None})


def check_privileges() -> None:
    """Root with CAP_NET_ADMIN and CAP_SYS_ADMIN (namespaces, mounts, a bridge), or one line saying which is missing."""
    if os.geteuid() != 0:
        raise ClusterError(f"the local cluster needs root (network namespaces, a bridge, mounts); running as uid "
                           f"{os.geteuid()}")
    effective = int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                         if line.startswith("CapEff:")), 16)
    for bit, name in ((12, "CAP_NET_ADMIN"), (21, "CAP_SYS_ADMIN")):
        if not effective >> bit & 1:
            raise ClusterError(f"the local cluster needs {name}, which this process lacks (a container without it?)")


def install() -> list[str]:
    """apt-get install whatever of PACKAGES is missing; returns what was installed."""
    if not missing_packages():
        return []
    check_privileges()
    with open("/tmp/gpt3d-local-cluster-install.lock", "w") as lock:  # one apt-get at a time (pytest workers)
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _apt_install(missing_packages())


def _apt_install(needed: list[str]) -> list[str]:
    if not needed:
        return []
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *needed]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [f"exit code {proc.returncode}"]
            raise ClusterError(f"{' '.join(cmd[:2])} {' '.join(needed)} failed: {tail[0]}")
    if still := missing_packages():
        raise ClusterError(f"after apt-get install, still missing: {' '.join(still)}")
    return needed


@dataclass
class Cluster:
    """A running local cluster, as recorded in <root>/cluster.json."""

    root: Path
    prefix: str  # of the namespaces' and links' names
    nodes: dict[str, str]  # node name -> address
    controller_addr: str
    prefix_len: int
    shared: list[str]
    pids: dict[str, int] = field(default_factory=dict)  # "munged", "slurmctld", "<node>/holder", "<node>/slurmd", ...
    started: dict[str, int] = field(default_factory=dict)  # each's start time (clock ticks since boot): a PID reused
    # by another process since (a stale cluster.json) is never signalled

    # --- names and environment ---------------------------------------------------------------------------------

    def netns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def host_end(self, node: str) -> str:
        return f"{self.prefix}-v{list(self.nodes).index(node) + 1}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    @property
    def state_file(self) -> Path:
        return self.root / "cluster.json"

    def env(self) -> dict[str, str]:
        """What a SLURM client needs to use this cluster (inside the nodes, ssh finds its keys and the other nodes
        in ~/.ssh, which is the cluster's ssh folder there)."""
        return {"SLURM_CONF": str(self.root / "slurm.conf")}

    def save(self) -> None:
        state = {**asdict(self), "root": str(self.root)}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_file)

    @classmethod
    def load(cls, root: Path) -> Cluster:
        path = Path(root) / "cluster.json"
        if not path.exists():
            raise ClusterError(f"no cluster recorded in {root} (no cluster.json); bring one up with "
                               f"python -m launch.local_cluster up {root}")
        state = json.loads(path.read_text())
        return cls(**{**state, "root": Path(state["root"])})

    # --- running commands ----------------------------------------------------------------------------------------

    def on_node(self, node: str, argv: list[str], wd: str | Path | None = None) -> list[str]:
        """The command line that runs argv inside `node` (its network, hostname and mount namespaces), in `wd`
        (default: this process's working directory)."""
        if node not in self.nodes:
            raise ClusterError(f"no node {node!r}; the nodes are {', '.join(self.nodes)}")
        holder = self.pids.get(f"{node}/holder")
        if holder is None:
            raise ClusterError(f"node {node} is down (lost); bring it back with revive")
        return ["nsenter", "-t", str(holder), "--net", "--uts", "--mount", f"--wd={wd or os.getcwd()}", "--", *argv]

    def slurm(self, *argv: str, check: bool = True, timeout: float = 30) -> str:
        """A SLURM client command (sinfo, squeue, scontrol, sbatch…) against this cluster; its stdout."""
        proc = subprocess.run(list(argv), capture_output=True, text=True, env={**os.environ, **self.env()},
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"{' '.join(argv)}: {proc.stderr.strip() or f'exit code {proc.returncode}'}")
        return proc.stdout

    def node_states(self) -> dict[str, str]:
        out = self.slurm("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)

    def wait_idle(self, nodes: list[str] | None = None, timeout: float = 60) -> None:
        """Until each of `nodes` (default all) is idle to SLURM."""
        want = nodes or list(self.nodes)
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if all(states.get(n, "").rstrip("*~#") == "idle" for n in want):
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"nodes not idle within {timeout:.0f} s: {states} (logs in {self.root}/log)")
            time.sleep(0.3)

    # --- starting ------------------------------------------------------------------------------------------------

    def _daemon(self, key: str, argv: list[str]) -> int:
        log = open(self.root / "log" / f"{key.replace('/', '-')}.out", "ab")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **self.env()})
        log.close()
        self._record(key, proc.pid)
        return proc.pid

    def _record(self, key: str, pid: int) -> None:
        self.pids[key], self.started[key] = pid, _start_time(pid)
        self.save()

    def _ours(self) -> dict[str, int]:
        """The recorded processes that are still the ones the cluster started."""
        return {key: pid for key, pid in self.pids.items() if _start_time(pid) == self.started.get(key)}

    def _start_node(self, node: str) -> None:
        (self.root / "state" / node).mkdir(parents=True, exist_ok=True)
        marker = self.root / "run" / f"holder.{node}"
        marker.unlink(missing_ok=True)
        self._daemon(f"{node}/unshare", ["nsenter", f"--net=/run/netns/{self.netns(node)}", "unshare", "--uts",
                                         "--mount", "--propagation", "private", "--fork", "--", "bash", "-c", HOLDER,
                                         "holder", node, str(self.root), *self.shared])
        _wait_for(lambda: marker.exists() and marker.read_text().strip(),
                  f"node {node}'s namespaces did not come up; see {self.root}/log/{node}-unshare.out")
        self._record(f"{node}/holder", int(marker.read_text()))
        self._daemon(f"{node}/slurmd", self.on_node(node, [find("slurmd"), "-D", "-N", node, "-f",
                                                           str(self.root / "slurm.conf")], wd=self.root))
        self._daemon(f"{node}/sshd", self.on_node(node, [find("sshd"), "-D", "-e", "-f",
                                                         str(self.root / "ssh" / f"sshd_config.{node}")], wd=self.root))

    def start(self, cpus: int, ctld_port: int, slurmd_port: int) -> None:
        for sub in ("log", "run", "state/ctld", "munge", "ssh", "shared"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        socket = self.root / "munge" / "munge.socket"
        if len(str(socket)) > UNIX_SOCKET_MAX:
            raise ClusterError(f"the cluster folder {self.root} is too deep: munge's socket path would be "
                               f"{len(str(socket))} characters, at most {UNIX_SOCKET_MAX}")
        key = self.root / "munge" / "munge.key"
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        ssh = self.root / "ssh"
        for name in ("id_ed25519", "host_ed25519"):
            if not (ssh / name).exists():
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"gpt3d-{name}", "-f",
                                str(ssh / name)], check=True)
        shutil.copy(ssh / "id_ed25519.pub", ssh / "authorized_keys")
        (ssh / "config").write_text(files.ssh_config(self.root, self.nodes))
        for node in self.nodes:
            (ssh / f"sshd_config.{node}").write_text(files.sshd_config(self.root, node))
        (self.root / "hosts").write_text(files.hosts(self.nodes, self.controller_addr))
        (self.root / "slurm.conf").write_text(files.slurm_conf(self.root, self.prefix, self.controller_addr, self.nodes,
                                                               cpus, ctld_port, slurmd_port))

        network.make_bridge(self.bridge, self.controller_addr, self.prefix_len)
        for node, addr in self.nodes.items():
            network.make_node_link(self.netns(node), self.host_end(node), self.bridge, addr, self.prefix_len)

        self._daemon("munged", [find("munged"), "-F", "--force", f"--socket={socket}", f"--key-file={key}",
                                f"--pid-file={self.root}/run/munged.pid", f"--log-file={self.root}/log/munged.log",
                                f"--seed-file={self.root}/munge/seed"])
        _wait_for(socket.exists, f"munged did not start; see {self.root}/log/munged.out")
        self._daemon("slurmctld", ["unshare", "--uts", "--", "bash", "-c",
                                   f'hostname {files.CONTROLLER_NAME} && exec "$0" -D -c -f "$1"',
                                   find("slurmctld"), str(self.root / "slurm.conf")])
        for node in self.nodes:
            self._start_node(node)
        self.wait_idle()

    # --- faults --------------------------------------------------------------------------------------------------

    def kill_node(self, node: str) -> None:
        """The node dies: its link goes down first (nothing it sends gets out, as at a power loss), then every
        process in its namespace is SIGKILLed, the holder with them (its local /tmp is gone)."""
        network.set_link(self.host_end(node), up=False)
        for _ in range(50):
            pids = network.namespace_pids(self.netns(node))
            if not pids:
                break
            for pid in pids:
                _signal(pid, signal.SIGKILL)
            time.sleep(0.05)
        for key, pid in self._ours().items():
            if key.startswith(f"{node}/"):
                _signal(pid, signal.SIGKILL)
        for key in [k for k in self.pids if k.startswith(f"{node}/")]:
            del self.pids[key], self.started[key]
        self.save()

    def revive(self, node: str) -> None:
        """A lost node comes back: fresh namespaces' holder, slurmd and sshd, its link up; idle again to SLURM."""
        if f"{node}/holder" in self.pids:
            raise ClusterError(f"node {node} is up; kill_node it first")
        # SLURM would wait SlurmdTimeout to take the node for dead and end its share of the jobs it ran: said
        # at once, as an administrator would. A down node returns to service when its slurmd registers.
        self.slurm("scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=revived", check=False)
        network.set_link(self.host_end(node), up=True)
        self._start_node(node)
        self.wait_idle([node])

    def cut_link(self, node: str) -> None:
        network.set_link(self.host_end(node), up=False)

    def restore_link(self, node: str) -> None:
        network.set_link(self.host_end(node), up=True)

    # --- stopping ------------------------------------------------------------------------------------------------

    def down(self) -> None:
        """End every process the cluster started or holds (SIGTERM, then SIGKILL after 5 s), remove its
        namespaces and bridge. The folder stays (logs, and the runs in its shared/)."""
        targets = set(self._ours().values())
        for node in self.nodes:
            targets.update(network.namespace_pids(self.netns(node)))
        for pid in targets:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p) for p in targets):
            time.sleep(0.1)
        for node in self.nodes:  # what a slurmd started meanwhile
            targets.update(network.namespace_pids(self.netns(node)))
        for pid in targets:
            _signal(pid, signal.SIGKILL)
        for pid in targets:
            _reap(pid)
        network.remove([self.netns(n) for n in self.nodes], [self.host_end(n) for n in self.nodes] + [self.bridge])
        self.pids.clear()
        self.started.clear()
        self.save()


def _wait_for(ready, failure: str, timeout_s: float = 10) -> None:
    """Until `ready()` is true; ClusterError(failure) after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise ClusterError(failure)
        time.sleep(0.05)


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields from the third on (state, ppid, …), or None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    """When process `pid` started (field 22 of /proc/<pid>/stat), or None when there is no such process."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited:
            return False
    except ChildProcessError:
        pass
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def up(root: Path, nodes: int = 2, subnet: str = "10.231.0.0/24", prefix: str = "gpt3d", shared: tuple[str, ...] = (),
       cpus: int = 4, ctld_port: int = 6817, slurmd_port: int = 6818) -> Cluster:
    """Install what is missing, then bring up a cluster of `nodes` nodes recorded in `root`; on any failure what
    was made is taken down again before the error is raised."""
    check_privileges()
    install()
    root = Path(root).resolve()
    if (root / "cluster.json").exists() and Cluster.load(root).pids:
        raise ClusterError(f"a cluster is already up in {root}; take it down first (python -m launch.local_cluster "
                           f"down {root})")
    if not 1 <= nodes <= 64:
        raise ClusterError(f"nodes={nodes}: a local cluster has 1 to 64 nodes")
    if len(prefix) > 10 or not prefix.replace("-", "").isalnum():
        raise ClusterError(f"prefix {prefix!r}: at most 10 letters, digits or dashes (interface names hold 15)")
    try:
        controller, addrs = network.addresses(subnet, nodes)
    except ValueError as error:
        raise ClusterError(f"--subnet {subnet}: {error}") from None
    if (route := network.subnet_in_use(subnet)) is not None:
        raise ClusterError(f"subnet {subnet} is already routed on this machine ({route}); pick another --subnet")
    root.mkdir(parents=True, exist_ok=True)
    names = [f"node{i + 1}" for i in range(nodes)]
    cluster = Cluster(root=root, prefix=prefix, nodes=dict(zip(names, addrs)), controller_addr=controller,
                      prefix_len=int(subnet.split("/")[1]), shared=sorted({str(root), *map(str, shared)}))
    cluster.save()
    try:
        cluster.start(cpus, ctld_port, slurmd_port)
    except BaseException:
        cluster.down()
        raise
    return cluster
