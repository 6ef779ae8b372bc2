"""python -m launch.local_cluster: a SLURM cluster of network namespaces on this machine (root).

  up DIR [--nodes N] [--subnet CIDR] [--prefix P] [--share PATH ...]   bring it up, recorded in DIR
  down DIR                                                              end its processes, remove its namespaces
  status DIR                                                            its nodes, as SLURM sees them
  env DIR                                                               the variables a client needs (eval "$(...)")
  exec DIR NODE -- CMD ...                                              run CMD inside a node
  kill-node DIR NODE | revive DIR NODE | cut-link DIR NODE | restore-link DIR NODE   faults

Example: python -m launch.local_cluster up /tmp/cl && eval "$(python -m launch.local_cluster env /tmp/cl)"
         && sbatch --nodes=2 --ntasks-per-node=1 --cpus-per-task=1 --gpus-per-node=0 launch/slurm.sbatch
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from launch.local_cluster.cluster import Cluster, up


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.local_cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="bring a cluster up")
    p_up.add_argument("root", type=Path)
    p_up.add_argument("--nodes", type=int, default=2)
    p_up.add_argument("--subnet", default="10.231.0.0/24")
    p_up.add_argument("--prefix", default="gpt3d")
    p_up.add_argument("--share", action="append", default=[], help="a folder every node sees (the cluster's "
                      "folder and this working directory always are)")
    for name in ("down", "status", "env"):
        sub.add_parser(name).add_argument("root", type=Path)
    p_exec = sub.add_parser("exec", help="run a command inside a node")
    p_exec.add_argument("root", type=Path)
    p_exec.add_argument("node")
    p_exec.add_argument("cmd", nargs=argparse.REMAINDER)
    for name in ("kill-node", "revive", "cut-link", "restore-link"):
        p = sub.add_parser(name)
        p.add_argument("root", type=Path)
        p.add_argument("node")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            cluster = up(args.root, nodes=args.nodes, subnet=args.subnet, prefix=args.prefix,
                         shared=(os.getcwd(), *args.share))
            print(f"cluster up in {cluster.root}: " + ", ".join(f"{n} {a}" for n, a in cluster.nodes.items())
                  + f"; controller {cluster.controller_addr}")
            print(f'use it: eval "$(python -m launch.local_cluster env {cluster.root})"')
            return 0
        cluster = Cluster.load(args.root)
        if args.command == "down":
            cluster.down()
            print(f"cluster in {cluster.root} is down")
        elif args.command == "status":
            for node, state in cluster.node_states().items():
                print(f"{node} {cluster.nodes.get(node, '?')} {state}")
        elif args.command == "env":
            for key, value in cluster.env().items():
                print(f"export {key}={shlex.quote(value)}")
        elif args.command == "exec":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            argv = cluster.on_node(args.node, cmd or ["bash"])
            os.environ.update(cluster.env())
            os.execvp(argv[0], argv)
        else:
            getattr(cluster, args.command.replace("-", "_"))(args.node)
        return 0
    except RuntimeError as error:  # ClusterError, or an `ip` command that failed (its own message)
        print(f"local_cluster: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
