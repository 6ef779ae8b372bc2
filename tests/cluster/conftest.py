"""One local SLURM cluster per pytest worker that runs these tests, up for its whole session (about a second),
down at its end: its processes ended by PID, its namespaces and bridge removed. Needs root; where the machine
refuses, every test here fails with one line saying why."""

import re

import pytest
from cli import write_corpus
from cluster_runs import bring_up


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    cluster = bring_up(tmp_path_factory.mktemp("cluster"))
    yield cluster
    cluster.down()


@pytest.fixture(scope="session")
def shared_corpus(cluster):
    folder = cluster.root / "shared" / "corpus"
    folder.mkdir(parents=True, exist_ok=True)
    return write_corpus(folder)


@pytest.fixture
def shared(cluster, request):
    """A folder of this test's own in the cluster's shared folder."""
    folder = cluster.root / "shared" / re.sub(r"[^\w.-]", "-", request.node.name)
    folder.mkdir(parents=True)
    return folder
