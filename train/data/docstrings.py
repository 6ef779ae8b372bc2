"""The English prose of a Python module's docstrings: the quickstart's corpus (``data=docstrings``).

A toy model trained for a few CPU minutes on Python source learns mostly its indentation: GPT-2's BPE
has a token per space of it, so a third of the standard library's tokens are single spaces, and the
sample a 200-step model writes is a run of them. Docstrings are the one large body of English prose
every Python install holds. Of a module, its classes' and its functions' docstrings (source order,
cleaned of their indentation as `inspect.cleandoc` does), a paragraph (lines between blank lines) is
kept when it is prose:

- no line of it is indented (code examples, argument lists, tables) or starts a doctest (``>>>``);
- it has at least MIN_WORDS words.

A kept paragraph's lines are joined by single spaces (docstrings wrap at ~72 columns; the wrap is not
part of the text), and paragraphs are separated by a blank line. A module without such prose gives an
empty document, which the pipeline skips.

A run reads the same files several times before its first step (the corpus probe, the validation
windows, the training streams), so each source is parsed once per process: its prose is kept by a digest
of the source text.
"""

from __future__ import annotations

import ast
import hashlib

MIN_WORDS = 8  # shorter paragraphs are headings, one-line summaries of arguments, "Return x." stubs
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
STATEMENT_LISTS = ("body", "handlers", "orelse", "finalbody", "cases")  # a statement's statements, in source order
_PARSED: dict[bytes, str] = {}  # a source's digest → its prose (see the module docstring)


def prose(source: str) -> str:
    """The prose paragraphs of every docstring of `source` (the text of a .py file), in source order;
    raises SyntaxError when it is not Python. A source seen before in this process is not parsed again."""
    key = hashlib.blake2b(source.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    if key not in _PARSED:
        _PARSED[key] = _parsed_prose(source)
    return _PARSED[key]


def _parsed_prose(source: str) -> str:
    paragraphs = []
    for node in _documented(ast.parse(source)):
        doc = ast.get_docstring(node, clean=True)
        paragraphs += [p for p in (_prose_paragraph(block) for block in (doc or "").split("\n\n")) if p]
    return "\n\n".join(paragraphs)


def _documented(node: ast.AST):
    """`node` and every module, class and function under it, in source order (a preorder walk of the
    statements only: a docstring's owner is a statement, so expressions, most of the tree, are not entered)."""
    if isinstance(node, DOCUMENTED):
        yield node
    for field in STATEMENT_LISTS:
        for child in getattr(node, field, ()):
            yield from _documented(child)


def _prose_paragraph(block: str) -> str | None:
    """`block`'s lines joined by single spaces, or None when it is not prose (see the module docstring)."""
    lines = block.strip("\n").split("\n")
    if any(line[:1].isspace() or line.lstrip().startswith(">>>") for line in lines):
        return None
    words = block.split()
    return " ".join(words) if len(words) >= MIN_WORDS else None
