"""The local cluster itself (launch/local_cluster): what a node is, and that `down` leaves nothing behind; and the
one line a machine that refuses namespaces gets."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
from cli import REPO
from cluster_runs import bring_up


def inside(cluster, node: str, *cmd: str) -> str:
    return subprocess.run(cluster.on_node(node, list(cmd), wd="/"), capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()


def test_a_node_has_its_own_hostname_address_and_tmp_and_sees_the_shared_folders(cluster):
    marker = cluster.root / "shared" / "seen-by-all"
    marker.write_text("shared")
    for node, address in cluster.nodes.items():
        assert inside(cluster, node, "hostname") == node
        assert address in inside(cluster, node, "ip", "-4", "-o", "addr", "show", "eth0")
        assert inside(cluster, node, "cat", str(marker)) == "shared"
        inside(cluster, node, "test", "-f", str(REPO / "launch" / "slurm.sbatch"))  # the checkout (raises if absent)
        inside(cluster, node, "sh", "-c", f"echo {node} > /tmp/local-{node}")
        assert not os.path.exists(f"/tmp/local-{node}")  # its /tmp is its own
    other = list(cluster.nodes)[1]
    assert inside(cluster, list(cluster.nodes)[0], "sh", "-c", f"ls /tmp/local-{other} 2>/dev/null || true") == ""
    for node in cluster.nodes:  # the session's cluster: other tests look at its nodes' /tmp
        inside(cluster, node, "rm", f"/tmp/local-{node}")
    # each node reaches the other by name, over the bridge
    first, second = cluster.nodes
    assert inside(cluster, first, "getent", "hosts", second).split()[0] == cluster.nodes[second]


def test_down_ends_every_process_it_started_and_removes_its_namespaces(tmp_path):
    cluster = bring_up(tmp_path / "c", instance=1)
    pids = set(cluster.pids.values())
    namespaces = [cluster.netns(node) for node in cluster.nodes]
    cluster.down()
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [name for name in namespaces if name in listed]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert cluster.bridge not in links and cluster.host_end(list(cluster.nodes)[0]) not in links


def test_without_root_up_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "c"
    folder.mkdir()
    os.chmod(tmp_path, 0o777)
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                           "launch.local_cluster", "up", str(folder)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs root" in lines[0] and "uid 65534" in lines[0], proc.stderr
