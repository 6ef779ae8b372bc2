"""Launch scripts (shell): torchrun.sh (one or many nodes), deepspeed.sh + hostfile.example, slurm.sbatch; and
local_cluster/, a SLURM cluster of network namespaces on one machine that the tests run them on.

See README.md ("Launch on several GPUs"), docs/parallelism.md and docs/cluster.md."""
