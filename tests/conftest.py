"""Fixtures shared by test modules."""

import pytest

from cli import write_corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The real-text corpus of tests/helpers/cli.py, written once per session (modules may define their own)."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))
