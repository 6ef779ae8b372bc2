"""The planner: what a layout holds in memory, sends and computes, and how long its step takes.

counts.py (parameters and state per rank), activations.py (activation memory), comm.py (collectives),
hardware.py (GPU figures), estimate.py (the plan of one layout), search.py (the best layouts),
tables.py (the tables), dry_run.py (the built model checked against the counts), from_config.py (from a
run's config sections; pre-flight), elastic.py (parallel.layout=auto), zero_buckets.py (DeepSpeed's ZeRO
buckets from the plan). The command is `python -m train.plan` (train/plan.py).
"""
