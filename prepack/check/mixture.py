"""What `verify` checks of a mixture build beyond any build's rules (`schemas/shard-format.md`,
"Mixtures"): every claim of the manifest's `mixture` recomputed, from its own arithmetic, the request
(`prepack.building.mixture`, as the build computes it), the totals, `inputs`, the packs and, where
they are at hand (an index build's stores), the sources.

- `mixture_manifest_problems`, the manifest alone: the build's `fingerprint` is the hash of the
  sources' ones; `inputs` are named SOURCE/… in source order with each source's rows; the request is
  a valid mixture (`MixtureSpec`: one of weight or epochs, …) whose `requested_tokens` (and weights)
  are each source's; the repeats follow from them (`full_epochs` = requested // eligible tokens, the
  copies within max_epochs).
- `mixture_pack_problems`, the packs: `source_ids`; with `pack_within_source` no pack of two sources;
  per source its documents, segments, tokens (and, where the mixture counts trained tokens, its
  `trained_tokens`: a full build's from the packs' labels, an index build's from its selection made
  again) and repeats; and its selection made again
  (`select_source`, seeded by `seed` and its name) from its packable tokens: its store's (an index
  build), else the packs' when it takes a full epoch (every eligible document is then packed). A full
  build's source taking no full epoch gives its eligible documents only to its source: they are held
  to the packs' as bounds.

Each finding is a dict of `prepack.check.verify.Problem`'s fields (this module does not import verify).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
from pydantic import ValidationError

from prepack.building.mixture import MAX_COPIES, MixtureSpec, PieceCounts, requested_tokens, select_source, selection_pieces
from prepack.errors import InputError
from prepack.formats.common import field_path
from prepack.formats.mixture import mixture_fingerprint
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
    if (digest := mixture_fingerprint([s.fingerprint for s in mixture.sources])) != manifest.fingerprint:
        yield _manifest("fingerprint", f"is {manifest.fingerprint}, but the hash of mixture.sources[].fingerprint is {digest}.")
    yield from _input_problems(manifest)
    yield from _request_problems(manifest)


def _input_problems(manifest: Manifest) -> Iterator[dict]:
    """`inputs` are the sources' files in source order, each named `SOURCE/…`, holding each source's rows."""
    sources = manifest.mixture.sources
    number = {s.name: i for i, s in enumerate(sources)}
    rows, last, ordered = [0] * len(sources), 0, True
    for entry in manifest.inputs:
        owner = number.get(entry.path.split("/", 1)[0])
        if ordered and (owner is None or owner < last):
            ordered = False  # one finding says it; each source's rows below say more
            yield _manifest(
                "inputs",
                f"list {entry.path!r} where a file of source {sources[last].name!r} or a later one is due: each "
                "is named SOURCE/… by its source, in source order.",
            )
        if owner is not None:
            last = max(last, owner)
            rows[owner] += entry.rows
    for i, s in enumerate(sources):
        if rows[i] != s.rows:
            yield _manifest(f"mixture.sources[{i}].name", f"is {s.name!r}, whose files in inputs hold {rows[i]} rows, but the source {s.rows}.")


def _request_problems(manifest: Manifest) -> Iterator[dict]:
    """The request as the build read it (a `MixtureSpec`), and what it asks of each source."""
    mixture = manifest.mixture
    for i, s in enumerate(mixture.sources):
        if (s.weight is None) == (s.epochs is None):
            yield _manifest(f"mixture.sources[{i}]", f"gives weight {s.weight} and epochs {s.epochs}: a source gives one of them.")
            return
    try:
        spec = MixtureSpec.model_validate(
            {
                "tokens": "all" if mixture.tokens is None else mixture.tokens,
                "seed": mixture.seed,
                "pack_within_source": mixture.pack_within_source,
                "sources": [s.model_dump(include={"name", "path", "weight", "epochs", "max_epochs"}) for s in mixture.sources],
            }
        )
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            yield _manifest(f"mixture.{field_path(error['loc'])}".removesuffix(".(top level)"), f"is not a mixture the build reads: {error['msg']}.")
        return
    try:
        expected = requested_tokens(spec, [s.eligible_tokens for s in mixture.sources])
    except InputError as exc:
        yield _manifest("mixture.tokens", str(exc))
        return
    asked = max(sum(s.requested_tokens for s in mixture.sources), 1)
    for i, (s, want) in enumerate(zip(mixture.sources, expected)):
        where = f"mixture.sources[{i}]"
        how = f"epochs {s.epochs} x eligible_tokens" if s.weight is None else f"weight {s.weight} of the budget {mixture.tokens}"
        if s.requested_tokens != want:
            yield _manifest(f"{where}.requested_tokens", f"is {s.requested_tokens}, but {how} asks for {want}.")
        if abs(s.requested_weight - s.requested_tokens / asked) > _WEIGHT_TOLERANCE:
            yield _manifest(f"{where}.requested_weight", f"is {s.requested_weight}, but requested_tokens / their sum is {s.requested_tokens / asked}.")
        if s.eligible_tokens == 0:
            yield _manifest(f"{where}.eligible_tokens", "is 0: a source without a token to pack is refused.")
            continue
        if s.full_epochs != s.requested_tokens // s.eligible_tokens:
            yield _manifest(f"{where}.full_epochs", f"is {s.full_epochs}, but requested_tokens // eligible_tokens is {s.requested_tokens // s.eligible_tokens}.")
        copies = s.full_epochs + (s.partial_documents > 0)
        limit = MAX_COPIES if s.max_epochs is None else min(s.max_epochs, MAX_COPIES)
        if copies > limit:
            field = "max_epochs" if s.max_epochs is not None and s.max_epochs <= MAX_COPIES else "full_epochs"
            yield _manifest(f"{where}.{field}", f"takes {copies} copies of some documents, more than {limit} (max_epochs {s.max_epochs}, MAX_COPIES {MAX_COPIES}).")


def mixture_pack_problems(
    segments,
    packs: np.ndarray,
    manifest: Manifest,
    where: Callable[[int], dict],
    complete: bool,
    packable: list[np.ndarray] | None = None,
    trained: list[PieceCounts] | None = None,
) -> Iterator[dict]:
    """The packs' segments (verify's `_Segments`: rows, pieces, lengths, copy, source, trained; sorted by row,
    copy, piece; `packs` each one's pack, as a number unique to it) against the mixture: each segment's
    source is the one whose rows hold its row; with `pack_within_source` a pack holds one source; with
    every pack read (`complete`), per source the documents, segments and tokens (a full build's trained
    tokens too, where the mixture counts them) are the manifest's, and
    its repeats too: every document it packs is packed full_epochs or full_epochs + 1 times,
    partial_documents of them the latter, and they are its selection made again (`_selection_problems`)
    from `packable` (each source's packable tokens, from its store), else from the packs; where the
    mixture counts trained tokens, from `trained` (each source's `PieceCounts`, from its store) alone."""
    rows, pieces, lengths, source_ids = segments.rows, segments.pieces, segments.lengths, segments.source
    mixture = manifest.mixture
    sources = mixture.sources
    first_rows = np.array([s.first_row for s in sources], dtype=np.int64)
    source_rows = np.array([s.rows for s in sources], dtype=np.int64)
    if (first_rows != np.cumsum(source_rows) - source_rows).any():
        return  # which source a row is of is unknown: `mixture_manifest_problems` names the first_row
    owner = np.searchsorted(first_rows, rows, "right") - 1
    for i in np.flatnonzero(source_ids.astype(np.int64) != owner)[:1]:
        yield {**where(int(i)), "column": "source_ids", "message": f"is {source_ids[i]}, but row {rows[i]} is of source {owner[i]} "
               f"({sources[owner[i]].name!r})."}
    if mixture.pack_within_source and len(packs):
        order = np.lexsort((owner, packs))
        same_pack = packs[order][1:] == packs[order][:-1]
        for k in np.flatnonzero(same_pack & (owner[order][1:] != owner[order][:-1]))[:1]:
            a, b = order[k], order[k + 1]
            place = where(int(a))
            yield _manifest(
                "mixture.pack_within_source",
                f"is true, but {place['file']} row {place['row']} holds documents of sources {sources[owner[a]].name!r} and "
                f"{sources[owner[b]].name!r}.",
            )
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
        if mixture.count is not None and manifest.index_of is None:  # the packs' labels give each segment's (`segments.trained`)
            found["trained_tokens"] = int(segments.trained[mine].sum())
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
        if len(per_row) != s.rows:  # rows past the source: `source_ids` and the rows' checks said so
            continue
        pieces_per_row = np.bincount(rows[mine] - s.first_row, minlength=s.rows)
        if mixture.count is not None:  # its selection counted trained tokens: the store's labels give them
            if trained is not None and packable is not None:
                yield from _selection_problems(number, manifest, packable[number], per_row, pieces_per_row, "its store", trained[number])
            continue
        once = mine & (segments.copy == 0)  # a document's packable tokens: its first copy's pieces
        in_packs = np.bincount(rows[once] - s.first_row, weights=lengths[once], minlength=s.rows).astype(np.int64)
        if packable is not None:
            yield from _selection_problems(number, manifest, packable[number], per_row, pieces_per_row, "its store")
        elif s.full_epochs:  # every eligible document is in the packs
            yield from _selection_problems(number, manifest, in_packs, per_row, pieces_per_row, "the packs")
        else:
            for name, value in (("eligible_documents", int((per_row > 0).sum())), ("eligible_tokens", int(in_packs.sum()))):
                if value > getattr(s, name):
                    yield _manifest(f"mixture.sources[{number}].{name}", f"is {getattr(s, name)}, but the packs hold {value} of source {s.name!r}'s.")


def _selection_problems(
    number: int,
    manifest: Manifest,
    tokens: np.ndarray,
    per_row: np.ndarray,
    segments_per_row: np.ndarray,
    given: str,
    trained: PieceCounts | None = None,
) -> Iterator[dict]:
    """Source `number`'s selection made again (`select_source`, by pieces where documents are split) from
    `tokens`, its documents' packable tokens as `given` says them (counted by `trained` where the mixture
    counts trained tokens), against its counts, the copies of each document in the packs (`per_row`), and
    the segments there of the document it cuts (`segments_per_row`)."""
    s, seed = manifest.mixture.sources[number], manifest.mixture.seed
    max_len = manifest.options.max_len
    packable = tokens
    if trained is not None:
        tokens = trained.documents(packable)
    where = f"mixture.sources[{number}]"
    if len(tokens) != s.rows:
        yield _manifest(f"{where}.rows", f"is {s.rows}, but {given} hold {len(tokens)} documents of source {s.name!r}.")
        return
    for name, value in (("eligible_documents", int(np.count_nonzero(tokens))), ("eligible_tokens", int(tokens.sum(dtype=np.int64)))):
        if value != getattr(s, name):
            yield _manifest(f"{where}.{name}", f"is {getattr(s, name)}, but {given} give {value} (with max_len, overflow and drop_untrained).")
    try:
        pieces = selection_pieces(tokens, max_len, manifest.options.overflow, trained)
        selection = select_source(s.name, tokens, s.requested_tokens, seed, s.max_epochs, pieces)
    except InputError as exc:
        yield _manifest(where, f"the build would have refused it: {exc}")
        return
    if trained is not None and selection.realized != s.trained_tokens:
        yield _manifest(f"{where}.trained_tokens", f"is {s.trained_tokens}, but the selection made again from {given} realizes {selection.realized}.")
    expected = np.zeros(s.rows, np.int64)
    expected[selection.eligible] = selection.epochs
    expected[selection.partial] += 1
    if (differ := np.flatnonzero(expected != per_row)).size:
        row = int(differ[0])
        yield _manifest(
            "mixture.seed",
            f"is {seed}, but the selection of source {s.name!r} made with it (seeded by the seed and the source's name, for "
            f"requested_tokens {s.requested_tokens}, its documents as {given} give them) is not what the packs hold: {differ.size} "
            "of its documents differ, the first "
            f"its row {row}, packed {per_row[row]} times, selected {expected[row]} times.",
        )
    if selection.cut_pieces:
        row = selection.cut_row
        whole = -(-int(packable[row]) // max_len)
        if (want := selection.epochs * whole + selection.cut_pieces) != segments_per_row[row]:
            yield _manifest(
                "mixture.seed",
                f"is {seed}, but the selection of source {s.name!r} made with it cuts its row {row} after {selection.cut_pieces} of "
                f"its {whole} pieces in its last copy ({want} segments in all), and the packs hold {segments_per_row[row]} of it.",
            )
