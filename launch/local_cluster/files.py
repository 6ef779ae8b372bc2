"""The text of the cluster's configuration files, each from the cluster's settings alone.

- slurm.conf: one controller on the bridge, the nodes at their addresses, one partition of all of them.
  SlurmdTimeout is SLURM's default (300: a silent node is taken for dead after five minutes); at a test
  cluster's pace: a requeued job may start CRED_EXPIRE_S after its requeue (AuthInfo cred_expire, 120 s by
  default), the scheduler looks at the queue every second (sched_interval, 60), KillWait 5 s (30),
  MessageTimeout 5 s (10), SlurmctldTimeout 10 s (120), finished jobs kept 600 s for scontrol (MinJobAge, 300).
- sshd_config: one per node (its own pid file), root by key only, keys in the cluster's folder.
- ssh_config: the client side, ~/.ssh/config inside the nodes (DeepSpeed's runner calls ssh and pdsh).
- hosts: every node's name and address, bound over /etc/hosts inside each node.
"""

from __future__ import annotations

from pathlib import Path

CRED_EXPIRE_S = 10
CONTROLLER_NAME = "gpt3d-ctl"


def slurm_conf(root: Path, cluster: str, controller_addr: str, nodes: dict[str, str], cpus: int,
               ctld_port: int, slurmd_port: int) -> str:
    node_lines = "\n".join(f"NodeName={name} NodeAddr={addr} CPUs={cpus} State=UNKNOWN" for name, addr in nodes.items())
    return f"""# written by python -m launch.local_cluster for a cluster of network namespaces on one machine
ClusterName={cluster}
SlurmctldHost={CONTROLLER_NAME}({controller_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire={CRED_EXPIRE_S}
StateSaveLocation={root}/state/ctld
SlurmdSpoolDir={root}/state/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
ReturnToService=2
SlurmdParameters=config_overrides
MailProg=/bin/true
SlurmdTimeout=300
SlurmctldTimeout=10
MessageTimeout=5
KillWait=5
MinJobAge=600
InactiveLimit=0
Waittime=0
JobRequeue=1
{node_lines}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def sshd_config(root: Path, node: str) -> str:
    return f"""# node {node}'s sshd, written by python -m launch.local_cluster
Port 22
HostKey {root}/ssh/host_ed25519
PidFile {root}/run/sshd-{node}.pid
AuthorizedKeysFile {root}/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
"""


def ssh_config(root: Path, nodes: dict[str, str]) -> str:
    hosts = "".join(f"Host {name}\n  HostName {addr}\n" for name, addr in nodes.items())
    return f"""# ssh to the cluster's nodes, written by python -m launch.local_cluster
{hosts}Host *
  User root
  IdentityFile {root}/ssh/id_ed25519
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
  BatchMode yes
  ConnectTimeout 5
"""


def hosts(nodes: dict[str, str], controller_addr: str) -> str:
    lines = [f"{addr} {name}" for name, addr in nodes.items()]
    return "\n".join(["127.0.0.1 localhost", f"{controller_addr} {CONTROLLER_NAME}", *lines]) + "\n"
