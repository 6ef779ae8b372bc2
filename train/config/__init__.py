"""The run's configuration: where it lives, its keys, its checks, and the run specification resolved once.

`resolve(cfg, run_dir)` (spec.py) checks everything that needs no model, data stream or process group
and returns a `RunSpec`: the model config, layout, batch ramp, LR schedule, resume point (with its
state.json, read once) and the planner's prediction. Builders and the loop read only that; no check
changes the Hydra config.
"""
