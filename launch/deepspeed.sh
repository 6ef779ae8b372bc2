#!/usr/bin/env bash
# Launch gpt3d with the deepspeed launcher. Without a hostfile it uses this node's GPUs; with
# HOSTFILE (see launch/hostfile.example) it starts the ranks on every listed node over ssh (run
# this once, on the first node; the nodes need passwordless ssh and a shared filesystem: DeepSpeed
# first runs `ssh <first host> hostname`, then pdsh -R ssh, with your ~/.ssh keys and config).
#
#   one node:     launch/deepspeed.sh model=gpt3-1.3b parallel.zero_stage=1
#   two nodes:    HOSTFILE=launch/hostfile.example launch/deepspeed.sh model=gpt3-13b parallel.tp=8 parallel.pp=2
set -euo pipefail
export GPT3D_RUN_STAMP="${GPT3D_RUN_STAMP:-$(date +%Y-%m-%d_%H-%M-%S)}"
ARGS=()
if [ -n "${HOSTFILE:-}" ]; then
  ARGS+=(--hostfile "$HOSTFILE" --master_addr "${MASTER_ADDR:-$(head -n1 "$HOSTFILE" | cut -d' ' -f1)}")
  # the launcher forwards variables listed in .deepspeed_env to every node
  echo "GPT3D_RUN_STAMP=$GPT3D_RUN_STAMP" > .deepspeed_env
elif [ -n "${NUM_GPUS:-}" ]; then
  ARGS+=(--num_gpus "$NUM_GPUS")
fi
exec deepspeed "${ARGS[@]}" --module train "hydra.run.dir=${RUN_DIR:-runs/deepspeed/$GPT3D_RUN_STAMP}" "$@"
