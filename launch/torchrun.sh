#!/usr/bin/env bash
# Launch gpt3d with torchrun on one node or many. Run the same command on every node; any extra
# arguments are Hydra overrides.
#
#   one node, 8 GPUs:   launch/torchrun.sh model=gpt3-1.3b parallel.tp=2
#   node 0 of 2:        NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 launch/torchrun.sh model=gpt3-6.7b parallel.tp=8 parallel.pp=2
#   node 1 of 2:        NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 launch/torchrun.sh model=gpt3-6.7b parallel.tp=8 parallel.pp=2
#
# Elastic (MAX_RESTARTS set, or NNODES a range MIN:MAX): torchrun's c10d rendezvous on MASTER_ADDR:MASTER_PORT;
# when a worker or node fails, torchrun stops the others and starts them again (at most MAX_RESTARTS times)
# on the nodes that are left (at least MIN), and they resume from the newest intact checkpoint of the same
# run directory. With parallel.layout=auto each start takes a layout that fits its world size. A node that
# dies without closing its connections is noticed by the ranks' heartbeat (train.peer_timeout_s, 20 s); the
# agents left then meet again, and the rendezvous waits its last call (30 s) for more nodes before it goes on
# with fewer; RDZV_CONF passes torchrun's --rdzv-conf (e.g. RDZV_CONF=last_call_timeout=10 on every node).
# (Tested across the nodes of a local SLURM cluster: docs/cluster.md.)
#
#   elastic, one node:  MAX_RESTARTS=3 launch/torchrun.sh model=gpt3-1.3b parallel.layout=auto
#   elastic, 2-4 nodes: NNODES=2:4 MAX_RESTARTS=3 MASTER_ADDR=10.0.0.1 GPT3D_RUN_STAMP=exp1 launch/torchrun.sh \
#                           model=gpt3-13b parallel.layout=auto          (the same line on every node)
#
# Multi-node runs need a run directory all nodes can reach (a shared filesystem): RUN_DIR, default
# runs/multinode/<GPT3D_RUN_STAMP>, which every node must agree on: set GPT3D_RUN_STAMP to the same value
# on all nodes (the SLURM script uses the job id). On one node the ranks name it from torchrun's start time,
# which restarted workers share.
set -euo pipefail
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
NPROC_PER_NODE="${NPROC_PER_NODE:-$(python -c 'import torch; print(torch.cuda.device_count() or 1)')}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
EXTRA=()
if [ "$NNODES" != 1 ]; then
  : "${GPT3D_RUN_STAMP:?set GPT3D_RUN_STAMP to the same value on every node (e.g. a date or job id)}"
  export GPT3D_RUN_STAMP
  EXTRA+=("hydra.run.dir=${RUN_DIR:-runs/multinode/$GPT3D_RUN_STAMP}")
fi
if [ -n "${MAX_RESTARTS:-}" ] || [[ "$NNODES" == *:* ]]; then
  # Each restart's workers get a store of their own: in the rendezvous' shared store the killed workers'
  # addresses would still be found, and the new process group would try to connect to them.
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  exec torchrun \
    --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" --max-restarts "${MAX_RESTARTS:-0}" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${GPT3D_RUN_STAMP:-gpt3d}" \
    --rdzv-conf "${RDZV_CONF:-}" \
    -m train "${EXTRA[@]}" "$@"
fi
exec torchrun \
  --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  -m train "${EXTRA[@]}" "$@"
