"""What keeps a run alive and honest: non-finite steps skipped and counted (nonfinite.py), stop
signals ending every rank after a checkpoint (preemption.py), hung steps ended (watchdog.py), all
driven from the loop through `Safeguards` (safeguards.py)."""
