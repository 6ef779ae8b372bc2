"""The run: the config resolved once into a run specification, then built and trained.

spec.py (resolve: the RunSpec), checks.py (what spans sections), run_folder.py (one run per folder),
schedule.py (what a resume may change), build.py (this rank's engine, data and checkpointer),
loop.py (step, log, evaluate, checkpoint), step.py (one optimizer step), engine.py (DeepSpeed's
config and engine), optimizer.py (AdamW and the LR by tokens), batch_ramp.py (GPT-3's batch ramp).
"""
