"""The settings: every key of every command's config, typed, with its one default and its check.

sections/ (one dataclass per section, each field a `setting(default, doc, check)` of settings.py),
command_line.py (the overrides checked before Hydra runs the job), keys.py (no unknown key),
entry.py (the config directory, the schema and resolvers, exit codes), launch.py (what the launcher
tells each process), usage.py (`python -m train --help`), key_table.py (docs/configuration.md's table).
Nothing here imports anything above it: the run resolves these sections (train/run/spec.py).
"""
