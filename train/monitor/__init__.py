"""What observes a run: metrics.py (metrics.jsonl, W&B, TensorBoard, MFU), report.py (the run's lines
and warnings, by the process that speaks for it), charts.py (its curves as a PNG)."""
