"""The data sections (train/config/sections/data.py): every key typed or checked, and one default per key.

Each data kind is composed as a run composes it (`data=<kind>`, its group file on its kind's schema); every
key the group file sets agrees with its schema's default, and the data component (train/data/sources.py)
reads the section's values, never defaults of its own: a bare mapping of the kind resolves to the same
pipeline and record keys as the composed config.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest
from omegaconf import OmegaConf

from train.config.sections.data import KINDS, NOT_SET, RECORD_KEYS, data_section
from train.config.settings import ConfigError
from train.data.sources import resolve

PIPELINE = ("streams", "shuffle_buffer", "workers", "prefetch", "on_bad_record", "read_retries", "read_retry_s",
            "read_timeout_s")


def composed(kind: str) -> dict:
    from hydra import compose, initialize_config_dir

    from train.config.entry import CONFIG_DIR, register_config

    register_config()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return OmegaConf.to_container(compose("config", overrides=[f"data={kind}"]).data, resolve=True)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_has_one_default_per_key(kind, tmp_path):
    schema = KINDS[kind]
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory() for f in
                dataclasses.fields(schema)}
    values = composed(kind)
    assert set(values) == set(defaults)  # the group file sets no key its schema lacks
    examples = {"sources"} if kind == "mixture" else set()  # mixture.yaml lists two example entries
    differing = {key: (values[key], defaults[key]) for key in defaults if key not in examples
                 and values[key] != defaults[key]}
    assert differing == {}
    bare = {"source": kind, **{key: "???" for key, value in defaults.items() if value == NOT_SET}}
    if kind == "mixture":
        bare["sources"] = [{"label": "code", "weight": 1, "source": "stdlib"}]
    if kind == "files":
        (tmp_path / "a.txt").write_text("A document of a few words.\n")
        bare["paths"] = [str(tmp_path / "a.txt")]
    if kind not in ("hub", "prepared"):  # (these need a dataset folder to resolve)
        spec, section = resolve(bare), data_section(bare)
        assert {key: getattr(spec, key) for key in PIPELINE} == {key: getattr(section, key, "skip") for key in PIPELINE}
        for key in RECORD_KEYS:
            if hasattr(section, key):
                assert getattr(spec.sources[0], key) == getattr(section, key) == defaults[key]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_no_data_key_is_an_unchecked_any(kind):
    """A field OmegaConf cannot type (a path or a list of them, a list of mappings) has a check beside it."""
    hints = typing.get_type_hints(KINDS[kind])
    for field in dataclasses.fields(KINDS[kind]):
        if hints[field.name] is typing.Any:
            assert field.metadata.get("check") is not None, f"data.{field.name} is Any without a check"


@pytest.mark.parametrize("values, message", [
    ({"source": "files", "paths": 3}, "data.paths=3: must be a path, a glob or a list of them"),
    ({"source": "stdlib", "streams": 0}, "data.streams=0 must be a whole number >= 1"),
    ({"source": "stdlib", "read_retry_s": -1}, "data.read_retry_s=-1 must be a number of seconds >= 0"),
    ({"source": "hub", "name": "x", "read_timeout_s": 0}, "data.read_timeout_s=0 must be a number of seconds > 0"),
    ({"source": "files", "paths": ["a"], "piece_chars": -1}, "data.piece_chars=-1 must be a whole number >= 0"),
    ({"source": "hub", "name": "x", "paths": ["a"]}, "data.paths is for source=files, not source=hub; remove it"),
    ({"source": "mixture", "sources": ["x"]}, "data.sources[0] must be a mapping with source, weight"),
    ({"source": "mixture"}, "data.source=mixture needs data.sources"),
])
def test_bad_values_are_refused_where_the_key_is_defined(values, message):
    with pytest.raises(ConfigError) as error:
        data_section(values)
    assert str(error.value).startswith(message)
