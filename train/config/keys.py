"""Unknown config keys: refused in every group, also when added with `+` or `++`.

Hydra composes the config in struct mode, so a misspelled `train.max_step=5` fails there; but
`+train.max_step=5` adds a key that nothing reads, and the run would silently ignore it. The keys a
run may have are those of the same composition without the command line's key additions (group
selections such as `data=files` are kept): where the command line adds keys, `check_known_keys` composes
that again with Hydra's compose API (about a second of CPU, so only then) and refuses any key beyond it,
naming the valid ones of its group. The
`deepspeed` group is DeepSpeed's pass-through, checked against DeepSpeed's own settings in
train/run/checks.py; lists (e.g. data.sources) are checked by the code that reads them.
"""

from __future__ import annotations

import difflib

from omegaconf import DictConfig, OmegaConf

from train.config.entry import CONFIG_DIR

PASS_THROUGH = ("deepspeed", "hydra")


def check_known_keys(cfg: DictConfig, config_name: str, overrides: list[str]) -> None:
    """Raise ValueError naming the first key of `cfg` that the config files do not define."""
    from hydra import compose
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    kept = [text for text, o in zip(overrides, parsed) if not (o.is_add() or o.is_force_add()) or _is_group(o.key_or_group)]
    if len(kept) == len(overrides):  # no key added: the reference would be `cfg`'s own composition
        return
    reference = compose(config_name=config_name, overrides=kept)
    for key, valid in _unknown(cfg, reference, ""):
        group, _, name = key.rpartition(".")
        near = difflib.get_close_matches(name, valid, n=3, cutoff=0.8)
        guess = f"did you mean {' or '.join(f'{group}.{n}' if group else n for n in near)}? " if near else ""
        raise ValueError(f"{key} is not a setting ('+' adds only keys that configs/ defines); {guess}"
                         f"valid keys of {group or 'the top level'}: {valid}")


def _is_group(name: str) -> bool:
    """A config group (a folder of configs/), as in `+plan=default`, rather than a key."""
    return (CONFIG_DIR / name.replace(".", "/")).is_dir()


def _unknown(cfg: DictConfig, reference: DictConfig, prefix: str):
    """(dotted key, sorted valid keys beside it) for every key of cfg missing from reference."""
    for key in cfg:
        path = f"{prefix}{key}"
        if not prefix and key in PASS_THROUGH:
            continue
        if key not in reference.keys():  # (`in` alone misses a key left '???'); the valid keys: those this command's config holds (not another's, left null)
            yield path, sorted(str(k) for k in reference if OmegaConf.is_missing(reference, k) or reference[k] is not None)
            continue
        value, known = cfg[key], reference[key]
        if isinstance(value, DictConfig) and isinstance(known, DictConfig) and not OmegaConf.is_missing(reference, key):
            yield from _unknown(value, known, f"{path}.")
