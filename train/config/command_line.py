"""The command line checked before Hydra runs the job: every override must name a setting or a config
that exists, and the run folder must be usable, else one line and EXIT_BAD_INPUT (2).

Hydra reports a misspelled key (`train.max_step=5`) by advising `+` to add it, an unknown config
(`model=doesnotexist`) with a traceback-like block, a value of the wrong type for its typed section
(`train.max_steps=abc`) as OmegaConf's validation error, and a run folder under a file with a raw
NotADirectoryError, all with exit code 1. `check_command_line` composes the same config first with
Hydra's compose API (milliseconds); only when that fails does it look at each override to name the
bad one: a value of the wrong type in the words of its field's own check (train/config/settings.py),
the nearest existing key (difflib over every dotted key of the config), or the group's configs. A
setting that has no default and is not given (`data=files` without data.paths) is named with an example.
Command lines with Hydra's own flags (--help, --cfg, -m, ...) are left to Hydra.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from train.config.entry import CONFIG_DIR
from train.config.settings import ConfigError

SKIPPED_ROOTS = ("hydra", "deepspeed")  # Hydra's own settings; DeepSpeed's pass-through (checked later)


def check_command_line(arguments: list[str], config_name: str = "config") -> None:
    """Raise ConfigError naming the first bad override, or a run folder that cannot be created."""
    if any(a.startswith("-") for a in arguments):
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        try:
            cfg = compose(config_name, overrides=arguments, return_hydra_config=True)
        except (HydraException, OmegaConfBaseException) as err:
            raise ConfigError(_explain(arguments, config_name, err)) from None
        run_dir = Path(str(cfg.hydra.run.dir))
    check_given(cfg)
    check_usable(run_dir)


def check_given(cfg: DictConfig, command: str = "python -m train") -> None:
    """Every setting without a default is given (data=files' data.paths, data=hub's data.name, data=prepared's
    data.path): else ConfigError saying which choice needs which setting, with an example of `command`."""
    from train.config.sections import DATA_KINDS, SECTIONS

    missing = sorted(re.sub(r"\[(\d+)\]", r".\1", key)  # data.sources[0].paths as the command line writes it
                     for root in cfg if root not in SKIPPED_ROOTS and isinstance(cfg[root], DictConfig)
                     for key in OmegaConf.missing_keys(cfg[root]))
    if not missing:
        return
    prefix, _, name = missing[0].rpartition(".")
    if prefix == "data" and cfg.data.get("source") in DATA_KINDS:
        raise ConfigError(DATA_KINDS[cfg.data.source].needed(name, f"data={cfg.data.source}", command))
    section = next((s for s in SECTIONS if s.PREFIX == prefix), None)
    if section is not None and name in {f.name for f in dataclasses.fields(section)}:
        raise ConfigError(section.needed(name, prefix, command))
    raise ConfigError(f"{missing[0]} is not set; give it on the command line ({missing[0]}=…)")


def explain(arguments: list[str], config_name: str, err: Exception) -> str:
    """One line naming the override Hydra refused (composing `config_name` with `arguments` raised `err`)
    and what would be valid."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return _explain(arguments, config_name, err)
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return _explain(arguments, config_name, err)


def _explain(arguments: list[str], config_name: str, err: Exception) -> str:
    from hydra import compose
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed = []
    for text in arguments:
        try:
            parsed.append((text, parser.parse_override(text)))
        except HydraException as bad:
            return f"cannot read the command-line argument {text!r} ({_first_line(bad)}); write key=value, quoting values with spaces or brackets"
    wrong_type = _wrong_type(parsed, err)
    if wrong_type:
        return wrong_type
    groups = [(text, o) for text, o in parsed if _is_group(o.key_or_group)]
    for text, o in groups:
        options = _options(o.key_or_group)
        value = o.value()
        if not o.is_delete() and isinstance(value, str) and value not in options:
            near = difflib.get_close_matches(value, options, n=1, cutoff=0.6)
            guess = f"did you mean {o.key_or_group}={near[0]}? " if near else ""
            return f"{text}: there is no {o.key_or_group} config {value!r}; {guess}{o.key_or_group} is one of {options}"
    try:
        reference = compose(config_name, overrides=[text for text, _ in groups])
    except HydraException:
        return _first_line(err)
    keys = _dotted_keys(reference)
    for text, o in parsed:
        key = o.key_or_group
        if key in reference and isinstance(reference[key], DictConfig) and not _is_group(key):
            return (f"{text}: {key} is a section of settings, not one value; set its keys, e.g. "
                    f"{key}.{next(iter(reference[key]))}=…; valid keys of {key}: {sorted(reference[key])}")
    for text, o in parsed:
        key = o.key_or_group
        if _is_group(key) or key.split(".")[0] in SKIPPED_ROOTS or o.is_add() or o.is_force_add():
            continue
        if key not in keys:
            near = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.75)
            parent = key.rpartition(".")[0]
            siblings = sorted(k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent)
            guess = f"did you mean {near[0]}? " if near else ""
            return f"{key} is not a setting; {guess}valid keys of {parent or 'the top level'}: {siblings}"
    return _first_line(err)


def _wrong_type(parsed: list, err: Exception) -> str | None:
    """OmegaConf's refusal of a value for its field's type (an int field given 'abc', a bool one 'perhaps'),
    as the field's own check words it: "train.max_steps='abc': must be a positive integer"."""
    from omegaconf.errors import ValidationError

    from train.config.sections import SECTIONS

    cause = err if isinstance(err, ValidationError) else err.__cause__
    if not isinstance(cause, ValidationError) or not getattr(cause, "full_key", None):
        return None
    prefix, _, name = str(cause.full_key).rpartition(".")
    section = next((s for s in SECTIONS if s.PREFIX == prefix), None)
    must = section.must(name) if section is not None else None
    value = next((o.value() for _, o in parsed if o.key_or_group == cause.full_key), cause.value)
    return f"{cause.full_key}={value!r}: {must}" if must else None


def _is_group(name: str) -> bool:
    return (CONFIG_DIR / name.replace(".", "/")).is_dir()


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group.replace(".", "/")).glob("*.yaml"))


def _dotted_keys(cfg: DictConfig, prefix: str = "") -> set[str]:
    """Every key of `cfg` as a dotted path, inner nodes included."""
    keys = set()
    for key in cfg:
        path = f"{prefix}{key}"
        keys.add(path)
        if not OmegaConf.is_missing(cfg, key) and isinstance(cfg[key], DictConfig):
            keys |= _dotted_keys(cfg[key], f"{path}.")
    return keys


def _first_line(err: Exception) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)


def check_usable(run_dir: Path) -> None:
    """The run folder exists or can be made: no file on its path, and its nearest existing folder takes a new
    folder (tried with a temporary one, removed at once: permission bits do not tell for root or /proc)."""
    for parent in [run_dir, *run_dir.parents]:
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"run folder {run_dir}: {parent} is a file, not a folder; choose hydra.run.dir=PATH "
                              "under a folder")
        if parent == run_dir and parent.is_dir():
            return  # there already (Hydra makes it before the checks of train/run/spec.py)
        if parent.is_dir():
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".gpt3d-probe-", dir=parent))
            except OSError as err:
                raise ConfigError(f"run folder {run_dir}: cannot create folders in {parent} ({err.strerror}); choose "
                                  "hydra.run.dir=PATH in a writable folder") from None
            return
