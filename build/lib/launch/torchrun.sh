#!/usr/bin/env bash
# Launch gpt3d with torchrun on one node or many. Run the same command on every node; any extra
# arguments are Hydra overrides.
#
#   one node, 8 GPUs:   launch/torchrun.sh model=gpt3-1.3b parallel.tp=2
#   node 0 of 2:        NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 launch/torchrun.sh model=gpt3-6.7b parallel.tp=8 parallel.pp=2
#   node 1 of 2:        NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 launch/torchrun.sh model=gpt3-6.7b parallel.tp=8 parallel.pp=2
#
# Multi-node runs need a run directory all nodes can reach (a shared filesystem): RUN_DIR, default
# runs/multinode/<GPT3D_RUN_STAMP>, which every node must agree on: set GPT3D_RUN_STAMP to the same value
# on all nodes (the SLURM script uses the job id).
set -euo pipefail
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
NPROC_PER_NODE="${NPROC_PER_NODE:-$(python -c 'import torch; print(torch.cuda.device_count() or 1)')}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
EXTRA=()
if [ "$NNODES" -gt 1 ]; then
  : "${GPT3D_RUN_STAMP:?set GPT3D_RUN_STAMP to the same value on every node (e.g. a date or job id)}"
  export GPT3D_RUN_STAMP
  EXTRA+=("hydra.run.dir=${RUN_DIR:-runs/multinode/$GPT3D_RUN_STAMP}")
fi
exec torchrun \
  --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  -m train "${EXTRA[@]}" "$@"
