"""`prepack build MIX.yaml` (or `--source` flags): a build from a mixture (`prepack.building.mixture`).

Each source is read as `build` reads a corpus or a store (`open_documents`, the same reading options
for every corpus source), twice, by the build's engine (`prepack.building.engines.base.Engine`: local,
or Ray tasks): first for its lengths alone (`read_lengths`: a store's shards read and checked against its
manifest's sha256, a corpus read and hashed, no token kept); then the selection (`select_source`) and the
plan (`plan_mixture`) are computed from the sources' lengths; then each source the first pass opened (its
corpus files, its store's manifest) is read again and only its selected documents' tokens copied into
scratch files of its own (`write_selected`, which refuses a source that changed meanwhile), so that scratch disk follows what is
selected, not the sources' size; and the engine writes the packs as for any build, from the sources'
token files laid back to back. With `--index-only` every source is a store beside the build: the first passes read only the stores' offsets, the shards hold the plan, and the manifest
names each source's store (`prepack.sources.mixture_stores` reads them back as one). The manifest's `inputs` are every source's files, named
`SOURCE/FILE`, in source order, and a pack's `source_rows` count over them (so a source's rows start
at its `first_row`); `mixture` records the request and what each source put into the packs.

A source without labels, mixed with sources that have them, is trained on every token: its labels are
its token ids (the collator still masks each document's first token).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, replace
from functools import partial
from importlib.metadata import version

import numpy as np

from prepack.sources.documents import Documents, Reading, open_documents
from prepack.building.engines.base import FirstPass, locate_row
from prepack.errors import DISTRIBUTION, InputError
from prepack.formats.shards import MANIFEST_NAME, InputFile, Manifest, Totals, write_manifest
from prepack.building.mixture import (
    Mixture,
    MixtureSpec,
    PieceCounts,
    SourceSelection,
    check_memory,
    mixture_parts,
    packable_tokens,
    piece_counts,
    requested_tokens,
    select_source,
    selection_pieces,
    source_location,
    trained_segments,
)
from prepack.formats.mixture import MixtureInfo, SourceCounts, mixture_fingerprint
from prepack.building.mixture_plan import MixturePlan, plan_mixture
from prepack.building.plan import compact_lengths
from prepack.storage.output import output_errors, staged_directory
from prepack.sources.store import is_store
from prepack.storage.remote import is_uri, local_input, staged_prefix
from prepack.building.write_shards import TokenFiles

__all__ = ["SourceTally", "build_mixture", "plan_sources", "with_row_starts"]


def _check_options(origin: str, out: str | os.PathLike, packing) -> None:
    """Refuse what a mixture build does not do, by name, before anything is read."""
    if packing.index_only and is_uri(out):
        raise InputError(
            f"{origin}: a mixture's index build is written to a local directory only (its readers open "
            "several stores beside it); build it in full to put it in object storage."
        )


def _tokenizer_check(spec: MixtureSpec, documents: list[Documents]) -> None:
    """Sources tokenized with different tokenizers would mix token ids of two vocabularies."""
    seen = {}
    for source, docs in zip(spec.sources, documents):
        if docs.tokenize is not None:
            seen.setdefault(docs.tokenize.tokenizer.sha256, source.name)
    if len(seen) > 1:
        raise InputError(
            f"sources {', '.join(map(repr, seen.values()))} were tokenized with different tokenizers "
            f"(sha256 {', '.join(s[:12] for s in seen)}): their token ids do not mean the same."
        )


def _label_files(firsts: list[FirstPass], token_firsts: np.ndarray) -> TokenFiles | None:
    """The sources' labels back to back: a source without labels is trained on every token."""
    if not any(first.has_labels for first in firsts):
        return None
    return _back_to_back([first.labels or first.tokens for first in firsts], token_firsts)


def _back_to_back(files: list[TokenFiles], token_firsts: np.ndarray) -> TokenFiles:
    """The sources' token files as one `TokenFiles`, source i's from token `token_firsts[i]` on."""
    return TokenFiles(
        tuple(path for f in files for path in f.paths),
        np.concatenate([f.firsts + first for f, first in zip(files, token_firsts)]).astype(np.int64),
    )


def build_mixture(
    mixture: Mixture,
    out: str | os.PathLike,
    reading: Reading,
    packing,
    output,
    bar,
    index_store_path: Callable[[str | os.PathLike, str | os.PathLike], str],
    engine_for: Callable[..., AbstractContextManager],
) -> Manifest:
    """Build `mixture` (read from a file or from flags) into `out` (`packing` and `output` as for
    `prepack.building.build.build_packs`, which calls this; `packing.seed` shuffles the packs, the
    mixture's `seed` selects the documents). `index_store_path` is build_packs' rule for how an index build names
    its store, and `engine_for` its engine for an output (`_engine`: the local one, or for `--engine ray`
    the Ray engine; an index build's on the driver), both passed in: this module is imported by it.
    Raises InputError for a bad mixture file or source, as `build` does for a corpus."""
    spec = mixture.spec
    _check_options(mixture.origin, out, packing)
    max_len, index_only = packing.max_len, packing.index_only
    with ExitStack() as stack:
        documents, store_paths = [], []
        for source in spec.sources:
            location = source_location(mixture, source)
            if index_only and (is_uri(location) or not is_store(location)):
                raise InputError(
                    f"{mixture.origin}: --index-only mixes local document stores, and source {source.name!r} ({source.path}) "
                    f"is not one: make it one with `prepack tokenize {source.path} --out STORE`."
                )
            store_paths.append(index_store_path(location, out) if index_only else None)  # refuses a store the build cannot name
            given = stack.enter_context(local_input(location))
            documents.append(open_documents(given.spec, reading, out, bar, given.location))
            if documents[-1].pairs is not None:  # selecting documents would split its groups
                raise InputError(
                    f"{mixture.origin}: source {source.name!r} ({source.path}) is a store of preference pairs or groups, "
                    "which a mixture does not select from; build it on its own."
                )
        _tokenizer_check(spec, documents)
        staged = staged_prefix if is_uri(out) else staged_directory
        staging = stack.enter_context(staged(out, output.overwrite))
        firsts, engines, trained = [], [], [] if spec.count == "trained" else None
        observe = None if trained is None else partial(trained_segments, max_len=max_len, overflow=packing.overflow)
        engine = stack.enter_context(engine_for(output.engine, output.ray_address, staging, index_only))
        for number, (source, docs) in enumerate(zip(spec.sources, documents)):
            engines.append(engine.for_source(number))
            first, observed = engines[-1].read_lengths(docs, reading, bar, observe)  # no token kept: the selection is not known
            _check_lengths(source.name, docs, first, max_len, packing.overflow)
            firsts.append(first)
            if trained is not None:
                trained.append(piece_counts(observed))
        plan, tallies, kept = plan_sources(spec, firsts, packing, trained)
        if not index_only:  # the second pass, of what the first opened: each source's selected documents' tokens into its scratch
            firsts = [
                source_engine.write_selected(docs, reading, first, keep, bar)
                for source_engine, docs, first, keep in zip(engines, documents, firsts, kept)
            ]
            plan = with_row_starts(plan, firsts, kept)
            selected = [int(first.lengths[keep].sum(dtype=np.int64)) for first, keep in zip(firsts, kept)]
            token_firsts = np.cumsum([0, *selected[:-1]], dtype=np.int64)  # each source's scratch files among them all
        del kept
        has_labels = any(first.has_labels for first in firsts)
        whole = FirstPass(
            lengths=np.concatenate([first.lengths for first in firsts]),
            untrained=np.concatenate([first.untrained for first in firsts]),
            rows_per_file=[],
            fingerprint=mixture_fingerprint([first.fingerprint for first in firsts]),
            has_labels=has_labels,
            tokens=None if index_only else _back_to_back([first.tokens for first in firsts], token_firsts),
            labels=None if index_only else _label_files(firsts, token_firsts),
        )
        shards = engine.write_packs(plan, whole, output.shard_size, bar)
        totals = plan.totals()
        manifest = Manifest(
            prepack_version=version(DISTRIBUTION),
            options=packing.manifest_options(output.shard_size, reading.column, "labels" if has_labels else None),
            has_labels=has_labels,
            fingerprint=whole.fingerprint,
            inputs=[
                InputFile(path=f"{source.name}/{docs.corpus.name(path)}", rows=rows)
                for source, docs, first in zip(spec.sources, documents, firsts)
                for path, rows in zip(docs.corpus.files, first.rows_per_file)
            ],
            totals=Totals(**totals, documents=sum(t.documents for t in tallies)),
            shards=shards,
            mixture=_mixture_info(spec, firsts, tallies, totals["tokens"], store_paths),
        )
        with output_errors(staging.build / MANIFEST_NAME):
            write_manifest(staging.build, manifest)
    return manifest


def _check_lengths(name: str, docs: Documents, first: FirstPass, max_len: int, overflow: str) -> None:
    """`--overflow error`: refuse a source's first document longer than max_len, by file, row and column."""
    if overflow == "error" and (first.lengths > max_len).any():
        row = int(np.flatnonzero(first.lengths > max_len)[0])
        path, file_row = locate_row(docs.corpus, first.rows_per_file, row)
        raise InputError(
            f"source {name!r}: {path}, row {file_row}, column {docs.column!r}: {first.lengths[row]} tokens, longer "
            f"than --max-len {max_len} (choose --overflow split, truncate or drop)."
        )


@dataclass(frozen=True)
class SourceTally:
    """What a source's selection came to, for the manifest (`SourceCounts`)."""

    eligible_documents: int
    eligible_tokens: int
    requested: int
    realized: int
    full_epochs: int
    partial_documents: int
    documents: int
    segments: int
    tokens: int  # packed: `realized`, unless the selection counts trained tokens


def plan_sources(
    spec: MixtureSpec, firsts: list[FirstPass], packing, trained: list[PieceCounts] | None = None
) -> tuple[MixturePlan, list[SourceTally], list[np.ndarray]]:
    """The selection of every source (`firsts`: their lengths and untrained flags) and the plan of the
    mixture's documents, and which rows of each source it packs (bool); the plan has no token starts yet
    (`with_row_starts`). Where documents are split (--overflow split), selection cuts the last document
    of a subset after a piece (`select_source`'s `pieces`). With `trained` (a mixture counting trained tokens: each source's `PieceCounts`), the
    request and the selection count trained tokens, and a document without one is not eligible (it adds
    nothing to the budget). Memory beyond the sources' lengths: the selection's
    rows (4 bytes a selected document) and the parts' plans. Raises InputError for a request beyond the
    copies allowed (`select_source`) or the machine's memory (`check_memory`), before the parts are
    allocated."""
    max_len, split = packing.max_len, packing.overflow in ("split", "error")
    packable = [packable_tokens(f.lengths, f.untrained, max_len, packing.overflow, packing.drop_untrained) for f in firsts]
    counted = packable if trained is None else [counts.documents(tokens) for counts, tokens in zip(trained, packable)]
    requested = requested_tokens(spec, [int(amounts.sum(dtype=np.int64)) for amounts in counted])
    selections, tallies = [], []
    for number, (source, tokens, amounts, asked) in enumerate(zip(spec.sources, packable, counted, requested)):
        pieces = selection_pieces(tokens, max_len, packing.overflow, None if trained is None else trained[number])
        selection = select_source(source.name, amounts, asked, spec.seed, source.max_epochs, pieces)
        # Pieces of each document as packed: a split document's ceil(length / max_len), else one.
        per_document = -(-tokens.astype(np.int64) // max_len) if split else np.minimum(tokens, 1)
        taken = selection.epochs * int(tokens[selection.eligible].sum(dtype=np.int64)) + int(tokens[selection.partial].sum(dtype=np.int64))
        segments = selection.epochs * int(per_document[selection.eligible].sum()) + int(per_document[selection.partial].sum())
        if selection.cut_pieces:  # the cut document's pieces left out
            taken -= int(tokens[selection.cut_row]) - selection.cut_pieces * max_len
            segments -= int(per_document[selection.cut_row]) - selection.cut_pieces
        tallies.append(
            SourceTally(
                eligible_documents=len(selection.eligible),
                eligible_tokens=selection.available,
                requested=selection.requested,
                realized=selection.realized,
                full_epochs=selection.epochs,
                partial_documents=len(selection.partial),
                documents=selection.documents,
                segments=segments,
                tokens=taken,
            )
        )
        selections.append(selection)
    del packable, counted, per_document
    if not any(t.documents for t in tallies):
        raise InputError("the mixture selects no document: every source was asked for no token.")
    check_memory(spec, selections)  # before the parts and their plans are allocated
    rows = np.array([len(f.lengths) for f in firsts], dtype=np.int64)
    first_rows = np.cumsum(rows) - rows
    parts, cuts = mixture_parts(selections, first_rows, int(rows.sum()), spec.pack_within_source, spec.seed)
    kept = [_selected_rows(s, len(f.lengths)) for s, f in zip(selections, firsts)]
    del selections
    plan = plan_mixture(
        parts,
        cuts,
        compact_lengths(np.concatenate([f.lengths for f in firsts])),
        np.concatenate([f.untrained for f in firsts]),
        first_rows,
        None,
        max_len,
        algorithm=packing.algorithm,
        overflow=packing.overflow,
        seed=packing.seed,
        drop_untrained=packing.drop_untrained,
        max_documents=packing.max_docs_per_pack,
    )
    return plan, tallies, kept


def _selected_rows(selection: SourceSelection, rows: int) -> np.ndarray:
    """Which of a source's `rows` its selection packs at least once (bool)."""
    selected = np.zeros(rows, dtype=bool)
    selected[selection.eligible if selection.epochs else selection.partial] = True
    return selected


def with_row_starts(plan: MixturePlan, firsts: list[FirstPass], kept: list[np.ndarray]) -> MixturePlan:
    """`plan` with every row's first token in the sources' scratch files laid back to back, where each
    source's file holds the rows it `kept` (8 bytes a source document, held while shards are written).
    A row kept by none starts where the next kept one does: no pack holds it."""
    lengths = np.concatenate([np.where(keep, f.lengths, 0) for f, keep in zip(firsts, kept)]).astype(np.int64)
    return replace(plan, row_starts=np.cumsum(lengths) - lengths)


def _mixture_info(
    spec: MixtureSpec, firsts: list[FirstPass], tallies: list[SourceTally], total_tokens: int, stores: list[str | None]
) -> MixtureInfo:
    """The manifest's `mixture`: the request, and per source the counts its packs must agree with."""
    asked = max(sum(t.requested for t in tallies), 1)
    sources, first_row = [], 0
    for source, first, tally, store in zip(spec.sources, firsts, tallies, stores):
        sources.append(
            SourceCounts(
                name=source.name,
                path=source.path,
                fingerprint=first.fingerprint,
                weight=source.weight,
                epochs=None if source.weight is not None else (source.epochs or 1.0),
                max_epochs=source.max_epochs,
                first_row=first_row,
                rows=len(first.lengths),
                eligible_documents=tally.eligible_documents,
                eligible_tokens=tally.eligible_tokens,
                requested_tokens=tally.requested,
                requested_weight=tally.requested / asked,
                full_epochs=tally.full_epochs,
                partial_documents=tally.partial_documents,
                documents=tally.documents,
                segments=tally.segments,
                tokens=tally.tokens,
                weight_realized=tally.tokens / total_tokens,
                trained_tokens=tally.realized if spec.count == "trained" else None,
                store=store,
            )
        )
        first_row += len(first.lengths)
    return MixtureInfo(
        tokens=None if spec.tokens == "all" else spec.tokens,
        seed=spec.seed,
        pack_within_source=spec.pack_within_source,
        sources=sources,
        count="trained" if spec.count == "trained" else None,
    )
