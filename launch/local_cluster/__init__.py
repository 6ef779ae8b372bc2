"""A SLURM cluster of network namespaces on one Linux machine, for the tests and for trying a launch before
renting nodes: `python -m launch.local_cluster up DIR` / `down DIR` (cluster.py says how it is built)."""
