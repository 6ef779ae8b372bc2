"""The planner: what a layout holds in memory, sends and computes, and how long its step takes.

counts.py (parameters and state per rank), activations.py (activation memory), comm.py (collectives),
hardware.py (GPU figures), estimate.py (the plan of one layout), search.py (the best layouts),
report.py (the table), dry_run.py (the built model checked against the counts), config.py (from a
run's Hydra config; pre-flight), __main__.py (`python -m train.plan`).
"""
