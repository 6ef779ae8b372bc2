"""Fixtures shared by test modules; each pytest-xdist worker computes on its share of the cores."""

import os

import pytest

from cli import write_corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The real-text corpus of tests/helpers/cli.py, written once per session (modules may define their own)."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def pytest_configure(config):
    """Under pytest-xdist, torch in each worker takes cores / workers threads (at least one): two workers on
    two cores, each with torch's default of one thread per core, would contend for every core."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
