"""Launch scripts (shell): torchrun.sh (one or many nodes), deepspeed.sh + hostfile.example, slurm.sbatch.

See README.md, section "Launching"."""
