"""The typed config sections: one field is a setting, checked, documented and delivered.

The central test copies the project, adds one field to TrainConfig (train/config/sections/train.py, the
only file edited) and, in the copy, composes and resolves configs and regenerates the settings table:
the new key is type-checked at composition, range-checked at resolution, in the docs' table, and in the
section the run's components receive.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli import REPO, TINY, clean_env

from train.config import key_table
from train.config.sections import Sections, TrainConfig
from train.config.settings import ConfigError

FIELD = '''    dummy_knob: int = setting(3, "a knob the test adds: how far it is turned", POSITIVE_INT)
'''
PROBE = r"""
import json, sys
from pathlib import Path
from hydra import compose, initialize_config_dir
from train.config.command_line import check_command_line
from train.config.entry import CONFIG_DIR, register_config
from train.config.settings import ConfigError
from train.run.spec import resolve
from train.config import key_table

register_config()
out = {"table": key_table.table()}
for value in ("5", "-1", "abc"):
    overrides = [*sys.argv[2:], f"train.dummy_knob={value}"]
    try:
        check_command_line([f"hydra.run.dir={sys.argv[1]}/{value}", *overrides])
        with initialize_config_dir(str(CONFIG_DIR), version_base=None):
            cfg = compose("config", overrides=overrides)
        out[value] = resolve(cfg, Path(sys.argv[1]) / value).sections.train.dummy_knob
    except ConfigError as err:
        out[value] = f"refused: {err}"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def with_a_new_field(tmp_path_factory) -> Path:
    """A copy of the project whose TrainConfig has one field more, and no other change."""
    copy = tmp_path_factory.mktemp("project") / "gpt3d"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", "*.egg-info"))
    section = copy / "train" / "config" / "sections" / "train.py"
    text = section.read_text()
    anchor = "    max_steps: int = setting("
    section.write_text(text.replace(anchor, FIELD + anchor, 1))
    return copy


def test_a_setting_added_as_one_field_is_checked_documented_and_delivered(with_a_new_field, tmp_path, corpus):
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path), *TINY, f"data.paths=[{corpus}/*.txt]"],
                          cwd=with_a_new_field,
                          env=clean_env({"PYTHONPATH": str(with_a_new_field)}), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["5"] == 5  # delivered: the train section the run's components receive holds it
    assert out["-1"] == "refused: train.dummy_knob=-1: must be a positive integer"  # its check, at resolution
    assert out["abc"] == "refused: train.dummy_knob='abc': must be a positive integer"  # its type, at composition
    assert "| `train.dummy_knob` | a knob the test adds: how far it is turned | 3 |" in out["table"]
    assert "train.dummy_knob" not in key_table.table()  # the field is the copy's alone


def test_the_settings_table_in_the_docs_is_current():
    assert key_table.DOC.read_text() == key_table.rewritten(key_table.DOC.read_text())


def test_a_resolved_section_is_read_only_and_a_changed_copy_is_checked_again():
    train = TrainConfig(max_steps=3)
    with pytest.raises(AttributeError, match="train.max_steps is read-only"):
        train.max_steps = 4
    sections = Sections(train, *(None,) * 5, deepspeed={})
    assert sections.replaced({"train.batch_ramp.start": 16}).train.batch_ramp.start == 16
    assert train.batch_ramp.start is None
    with pytest.raises(ConfigError, match=r"train.max_steps=0: must be a positive integer"):
        sections.replaced({"train.max_steps": 0})
