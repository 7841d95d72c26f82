"""What `verify` checks of a mixture build beyond any build's rules (`schemas/shard-format.md`,
"Mixtures"): the manifest's `mixture` against its own arithmetic and the totals, and the packs'
`source_ids` and per-source counts against it.

Each finding is a dict of `prepack.check.verify.Problem`'s fields (this module does not import verify).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from prepack.formats.shards import MANIFEST_NAME, Manifest

__all__ = ["copy_numbers", "mixture_manifest_problems", "mixture_pack_problems"]

# realized weights are written as floats; a reader recomputing them may round otherwise
_WEIGHT_TOLERANCE = 1e-9


def copy_numbers(rows: np.ndarray, pieces: np.ndarray) -> np.ndarray:
    """For segments sorted by (row, piece): how many earlier segments have the same (row, piece), i.e.
    which copy of its document each is (0 for the first)."""
    same = np.zeros(len(rows), dtype=bool)
    same[1:] = (rows[1:] == rows[:-1]) & (pieces[1:] == pieces[:-1])
    group_start = np.maximum.accumulate(np.where(~same, np.arange(len(rows)), 0))
    return np.arange(len(rows)) - group_start


def _manifest(column: str, message: str) -> dict:
    return {"file": MANIFEST_NAME, "column": column, "message": message}


def mixture_manifest_problems(manifest: Manifest) -> Iterator[dict]:
    """The mixture's own arithmetic: sources back to back over `inputs`, each source's documents from
    its repeats, and the sums over sources equal to the totals."""
    mixture, t = manifest.mixture, manifest.totals
    first_row = 0
    for number, s in enumerate(mixture.sources):
        where = f"mixture.sources[{number}]"
        if s.first_row != first_row:
            yield _manifest(f"{where}.first_row", f"is {s.first_row}, but the sources before it hold {first_row} rows.")
        first_row += s.rows
        if s.documents != s.full_epochs * s.eligible_documents + s.partial_documents:
            yield _manifest(
                f"{where}.documents",
                f"is {s.documents}, but full_epochs x eligible_documents + partial_documents is "
                f"{s.full_epochs * s.eligible_documents + s.partial_documents}.",
            )
        if s.partial_documents > s.eligible_documents or s.eligible_documents > s.rows:
            yield _manifest(f"{where}", f"{s.partial_documents} partial of {s.eligible_documents} eligible of {s.rows} rows.")
        if abs(s.weight_realized - (s.tokens / t.tokens if t.tokens else 0)) > _WEIGHT_TOLERANCE:
            yield _manifest(f"{where}.weight_realized", f"is {s.weight_realized}, but tokens / totals.tokens is {s.tokens / t.tokens}.")
    rows = sum(f.rows for f in manifest.inputs)
    if rows != first_row:
        yield _manifest("inputs", f"hold {rows} rows, but the mixture's sources {first_row}.")
    for name in ("documents", "segments", "tokens"):
        summed = sum(getattr(s, name) for s in mixture.sources)
        if summed != getattr(t, name):
            yield _manifest(f"totals.{name}", f"is {getattr(t, name)}, but the sum over mixture.sources is {summed}.")


def mixture_pack_problems(
    rows: np.ndarray,
    pieces: np.ndarray,
    lengths: np.ndarray,
    source_ids: np.ndarray,
    manifest: Manifest,
    where: Callable[[int], dict],
    complete: bool,
) -> Iterator[dict]:
    """The packs' segments (sorted by row, copy, piece) against the mixture: each segment's source is
    the one whose rows hold its row; with every pack read (`complete`), per source the documents,
    segments and tokens are the manifest's, and its repeats too: every document it packs is packed
    full_epochs or full_epochs + 1 times, partial_documents of them the latter."""
    sources = manifest.mixture.sources
    first_rows = np.array([s.first_row for s in sources], dtype=np.int64)
    owner = np.searchsorted(first_rows, rows, "right") - 1
    for i in np.flatnonzero(source_ids.astype(np.int64) != owner)[:1]:
        yield {**where(int(i)), "column": "source_ids", "message": f"is {source_ids[i]}, but row {rows[i]} is of source {owner[i]} "
               f"({sources[owner[i]].name!r})."}
    if not complete:
        return
    first_piece = pieces == 0
    for number, s in enumerate(sources):
        mine = owner == number
        found = {
            "documents": int((mine & first_piece).sum()),
            "segments": int(mine.sum()),
            "tokens": int(lengths[mine].sum()),
        }
        for name, value in found.items():
            if value != getattr(s, name):
                yield _manifest(f"mixture.sources[{number}].{name}", f"is {getattr(s, name)}, but the packs hold {value} of source {s.name!r}.")
        # Copies per packed document: the highest copy number of its first piece, plus one.
        documents = mine & first_piece
        per_row = np.bincount(rows[documents] - s.first_row, minlength=s.rows) if s.rows else np.zeros(0, np.int64)
        taken = per_row[per_row > 0]
        allowed = (taken == s.full_epochs) | (taken == s.full_epochs + 1)
        extra = int((taken == s.full_epochs + 1).sum())
        if not allowed.all() or extra != s.partial_documents or (s.full_epochs and len(taken) != s.eligible_documents):
            yield _manifest(
                f"mixture.sources[{number}]",
                f"says {s.full_epochs} full epochs of {s.eligible_documents} documents and {s.partial_documents} "
                f"more, but the packs hold {len(taken)} of its documents, taken {sorted(set(taken.tolist()))} times, "
                f"{extra} of them full_epochs + 1 times.",
            )
