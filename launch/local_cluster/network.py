"""The cluster's network: one Linux bridge on this machine, and per node a network namespace joined to it by
a veth pair, with its own address. `ip` (iproute2) does all of it; every call is checked.

The bridge holds the first address of the subnet (the controller's, in this machine's own namespace); node i
holds the (10 + i)th. Cutting a node's link sets the host end of its pair down: the node and the others can no
longer reach each other, and nothing on either side is told (no reset, no FIN), as when a cable or switch port
fails.
"""

from __future__ import annotations

import ipaddress
import subprocess


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`ip ARGS`, its output captured; a failure raises with ip's own message."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip() or f'exit code {proc.returncode}'}")
    return proc


def addresses(subnet: str, nodes: int) -> tuple[str, list[str]]:
    """(the controller's address, each node's), in `subnet` (an IPv4 network, e.g. 10.231.0.0/24)."""
    net = ipaddress.ip_network(subnet)
    hosts = list(net.hosts())
    if len(hosts) < 10 + nodes:
        raise ValueError(f"subnet {subnet} holds {len(hosts)} addresses; {nodes} nodes need at least {10 + nodes}")
    return str(hosts[0]), [str(hosts[10 + i]) for i in range(nodes)]


def subnet_in_use(subnet: str) -> str | None:
    """The route already covering `subnet` on this machine, if any (two clusters on one subnet would collide)."""
    net = ipaddress.ip_network(subnet)
    for line in ip("-4", "route", "show").stdout.splitlines():
        for word in line.split()[:2]:  # "10.0.0.0/8 dev …", or a type first: "blackhole 10.0.0.0/8"
            try:
                dest = ipaddress.ip_network(word, strict=False)
            except ValueError:
                continue
            if dest.overlaps(net):
                return line
            break
    return None


def make_bridge(bridge: str, address: str, prefix: int) -> None:
    ip("link", "add", bridge, "type", "bridge")
    ip("addr", "add", f"{address}/{prefix}", "dev", bridge)
    ip("link", "set", bridge, "up")


def make_node_link(netns: str, host_end: str, bridge: str, address: str, prefix: int) -> None:
    """Namespace `netns` with loopback up and `eth0` at `address`, whose other end `host_end` is on `bridge`."""
    ip("netns", "add", netns)
    ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", netns)
    ip("link", "set", host_end, "master", bridge)
    ip("link", "set", host_end, "up")
    ip("-n", netns, "addr", "add", f"{address}/{prefix}", "dev", "eth0")
    ip("-n", netns, "link", "set", "eth0", "up")
    ip("-n", netns, "link", "set", "lo", "up")


def set_link(host_end: str, up: bool) -> None:
    ip("link", "set", host_end, "up" if up else "down")


def namespace_pids(netns: str) -> list[int]:
    """Every process in `netns` (empty when it is gone)."""
    proc = ip("netns", "pids", netns, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def remove(netns_names: list[str], links: list[str]) -> None:
    """Remove what exists of these namespaces and links (the bridge among them); what is absent is skipped."""
    for name in netns_names:
        ip("netns", "del", name, check=False)
    for link in links:
        ip("link", "del", link, check=False)
