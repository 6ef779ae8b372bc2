"""Long documents cut into pieces at natural boundaries, so that one big text file trains like a corpus.

A `.txt` file is one document. A single book, or a handful of them, would give fewer documents than
data.streams and no held-out document for validation. With ``data.piece_chars = L > 0`` every text
file longer than L characters is cut into pieces of at most L characters:

  from the current start, if what is left fits in L characters it is the last piece; otherwise the
  piece ends just after the last blank line ("\\n\\n") within the next L characters, else after the
  last line end ("\\n"), else after exactly L characters.

The pieces, joined, give back the text exactly; the cut depends only on the text and L, so it is the
same on every rank, at every dp and on every resume. Piece k of file f counts as record ``f + k``:
it belongs to stream ``(f + k) mod data.streams``, so a one-piece file keeps the stream it always had
and the pieces of one long file are dealt round-robin over all streams. Of a file cut into n ≥ 2
pieces, the last ``max(1, round(n · val_permille / 1000))`` pieces are held out for validation (when
val_permille > 0): the end of a book is text the model never trains on. Unsplit documents keep the
split by hash of their text (records.is_validation). Each piece is packed as a document (its tokens,
then <|endoftext|>).
"""

from __future__ import annotations


def cut(text: str, limit: int) -> list[str]:
    """`text` as consecutive pieces of at most `limit` characters (see the module docstring); [text] when
    limit is 0 or the text fits. ''.join(cut(text, limit)) == text."""
    if limit <= 0 or len(text) <= limit:
        return [text]
    pieces, start = [], 0
    while len(text) - start > limit:
        window = text[start : start + limit]
        end = window.rfind("\n\n")
        end = end + 2 if end > 0 else window.rfind("\n") + 1
        end = end if end > 0 else limit
        pieces.append(text[start : start + end])
        start += end
    pieces.append(text[start:])
    return pieces


def held_out(n_pieces: int, val_permille: int) -> int:
    """How many trailing pieces of a document cut into `n_pieces` go to validation."""
    if n_pieces < 2 or val_permille <= 0:
        return 0
    return max(1, round(n_pieces * val_permille / 1000))
