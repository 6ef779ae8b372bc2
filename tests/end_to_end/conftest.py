"""Every test of this folder runs the commands end to end (tens of seconds each): all are marked `slow`, so
`pytest -m "not slow"` is the quick subset."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)
