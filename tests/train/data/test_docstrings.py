"""data=docstrings: the prose of the standard library's docstrings, the quickstart's corpus."""

from __future__ import annotations

import os
import sysconfig

from train.data import records as data_records
from train.data import sources as data_sources
from train.data.docstrings import prose

MODULE = '''"""A module whose docstrings mix prose with what is not prose.

This paragraph is prose: it has more than eight words and
wraps over two lines, which become one.

    indented = "code"   # a code example: left out

>>> doctest()
3

Too short.
"""


class Widget:
    """Widgets are small parts that fit together in many different ways.

    Args:
        size: an argument list is indented, so it is left out
    """

    def grow(self):
        x = "a string statement is not a docstring, however many words it holds"
        return x


async def fetch():
    """Fetch the widget from a store that may be very far away indeed."""
'''

EXPECTED = (
    "A module whose docstrings mix prose with what is not prose."
    "\n\nThis paragraph is prose: it has more than eight words and wraps over two lines, which become one."
    "\n\nWidgets are small parts that fit together in many different ways."
    "\n\nFetch the widget from a store that may be very far away indeed."
)


def test_prose_keeps_only_unindented_paragraphs_of_eight_words_in_source_order():
    assert prose(MODULE) == EXPECTED


def test_the_source_is_the_standard_library_without_its_tests(tmp_path):
    root = sysconfig.get_paths()["stdlib"]
    spec = data_sources.resolve({"source": "docstrings"}).sources[0]
    stdlib = data_sources.resolve({"source": "stdlib"}).sources[0]
    relative = [os.path.relpath(f, root) for f in spec.files]
    assert os.path.join(root, "os.py") in spec.files and set(spec.files) < set(stdlib.files)
    assert not any(part in data_sources.TEST_FOLDERS for path in relative for part in path.split(os.sep)[:-1])
    assert not any(os.path.basename(path).startswith("test_") for path in relative)
    assert [f for f in stdlib.files if f in set(spec.files)] == list(spec.files)  # the stdlib's own order
    # a stream's documents: its own files' prose, in order; a file that is not Python is a bad record
    (tmp_path / "good.py").write_text(MODULE)
    (tmp_path / "bad.py").write_text("def broken(:\n")
    (tmp_path / "bare.py").write_text("x = 1\n")
    files = tuple(str(tmp_path / n) for n in ("good.py", "bad.py", "bare.py"))
    source = data_sources.SourceSpec("docstrings", "docstrings", "docstrings", files=files)
    got = list(data_records.records(source, 0, 1))
    assert [r.text for r in got[::2]] == [EXPECTED, ""]
    assert got[1].text.reason == "not_python" and "not Python source" in got[1].text.detail
    assert [r.text for r in data_records.records(source, 1, 2)] == [got[1].text]  # stream 1 of 2 opens file 1 only


def test_its_documents_are_prose():
    spec = data_sources.resolve({"source": "docstrings"}).sources[0]
    texts = [r.text for r, _ in zip(data_records.records(spec, 0, 1), range(40))]
    assert all(isinstance(t, str) for t in texts) and sum(len(t) for t in texts) > 10_000
    lines = [line for t in texts for line in t.split("\n")]
    assert not any(line[:1].isspace() or line.startswith(">>>") for line in lines)


def test_a_run_parses_each_file_once_before_its_first_step(monkeypatch):
    """A run's start: the probe, the validation windows and the first training batch read the same files; each
    file's source is parsed once (the quickstart parsed 548 files three times before its first step)."""
    from train import data
    from train.data import docstrings
    from train.data.probe import Evaluation

    parses, parse = [], docstrings._parsed_prose
    monkeypatch.setattr(docstrings, "_PARSED", {})
    monkeypatch.setattr(docstrings, "_parsed_prose", lambda source: parses.append(hash(source)) or parse(source))
    # the toy's windows and batch, one validation batch and a small shuffle buffer: the same reads, fewer files
    spec = data.check_data({"source": "docstrings", "val_permille": 10, "shuffle_buffer": 64}, global_batch=8,
                           evaluation=Evaluation(129, 8, 1))
    validation = data.validation_batches(spec, 128, 8, 1, 0, 1)
    batch = data.TrainBatches(spec, 128, 8, 0, 1, 1234).next_batch(8)
    assert len(validation) == 1 and batch.shape == (8, 129)
    assert parses and len(parses) == len(set(parses))
