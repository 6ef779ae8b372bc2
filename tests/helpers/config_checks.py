"""The checks `python -m train` runs on a command line before any work, for tests: the overrides (names and
types, train/config/command_line.py), then every section's own checks and the device (train/run/spec.py's
first step)."""

from __future__ import annotations

from train.config.settings import ConfigError


def refusal(overrides: list[str], run_dir: str = "/tmp/gpt3d-config-check") -> str | None:
    """The one-line refusal of the first bad value among `overrides`, or None when they all pass."""
    from hydra import compose, initialize_config_dir

    from train.config.command_line import check_command_line
    from train.config.entry import CONFIG_DIR, register_config
    from train.config.sections import Sections
    from train.run.checks import check_runtime

    register_config()
    try:
        check_command_line([f"hydra.run.dir={run_dir}", *overrides])
        with initialize_config_dir(version_base=None, config_dir=str(CONFIG_DIR), job_name="test"):
            sections = Sections.of(compose("config", overrides=overrides))
        check_runtime(sections.train)
    except ConfigError as err:
        return str(err)
    return None
