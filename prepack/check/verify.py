"""`verify`: check a build against its manifest, the shard format and, with a source, the corpus.

What is checked, in this order (each problem names the file, row and column it was found in):

1. the manifest's own arithmetic: totals against each other, against the shard entries and inputs;
2. the directory, by `lstat` alone (`shard_file_problems`): shards named `shard-00000.arrow`, … in
   manifest order, none missing, each a regular file (no symbolic link, FIFO or device) of the
   manifest's byte size, none extra;
3. every shard: sha256 against the manifest (when the size is right); as `open_shard` reads it, an
   Arrow stream with the format's schema and one uncompressed record batch whose list offsets slice
   their values; its row and token counts against the manifest; every row as `check_shard` checks it
   (lengths ≤ max_len, `segment_ids` ↔ `cu_seqlens`, `max_seqlen`, provenance lengths, token ids and
   labels), plus provenance rows inside the corpus and documents in (row, piece) order inside each
   pack. Problems come from those checks as fields (`FormatError.problem`), never parsed from text;
4. across shards: every (corpus row, piece) in one pack only, pieces numbered 0, 1, … without gaps,
   every piece but a document's last holding max_len tokens, and the counts of documents, splits and
   segments against the manifest; a mixture's every claim (`prepack.check.mixture`) and a pair build's
   `pairs`, counted from its tokens (`prepack.check.pairs`);
5. with `source`: the corpus is read as the build read it (`open_documents`): streamed, or tokenized
   again with the given tokenizer when the build tokenized it, or read from a document store made
   from it (memory bounded by its batches), and every document must come out of the packs exactly as the manifest's max_len
   and overflow say (`document_pieces`, the definition the build plans with): its pieces all
   present, same lengths, same tokens and labels; rows and tokens the build left out must be the
   manifest's empty, truncated, dropped and (with drop_untrained) untrained counts, and the corpus
   files its `inputs`; a group build's stored scores and ranks those of each document's corpus row.

An index build (`Manifest.store`) is checked the same way, its packs' tokens read from its store
(the one its manifest names inside the build's parent directory, or the caller's `store`): its
manifest's `store.fingerprint` must be its `fingerprint` and every index shard's
`prepack.store_fingerprint` (step 1 and 3), its store must be there with that fingerprint (`open_build_store`), every store shard must
have its store manifest's sha256 and sound contents, as the loader checks them, and the store's
documents that fingerprint (step 2b); every (document, piece, length) of a pack must lie inside its
store document. Without `source` its packs are then held to the store's documents as step 5 holds a
full build's to the corpus (pieces, lengths, counts, inputs), tokens aside, which are the store's.

A build in object storage (a URI) is checked the same way, its shards (and its store's) read through a
`prepack.storage.cache.ShardCache`, which checks each one's size and sha256 as it downloads it (step 2 and the
sha256 of step 3); its problems name the objects by their URIs (`Problem.location`). A source at a URI is
copied locally first (`prepack.storage.remote.local_input`) and its files named by their URIs.

A document store is checked on its own by `verify_store`: step 2b for the store alone (its `store.json`, every
shard's sha256 and contents, the fingerprint of its documents and each generation's, `length_counts`), the
`.arrow` files it does not list, and a pair or group store's prompts; its problems name its files inside it.

A shard that cannot be read or has malformed rows is left out of steps 4 and 5, and so are the checks
there that need every pack (a document missing from the packs might be in that shard): one problem says
so, instead of a cascade of follow-on reports.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from prepack.storage.cache import ShardCache, build_cache
from prepack.check.mixture import copy_numbers, mixture_manifest_problems, mixture_pack_problems
from prepack.check.pairs import PairCounts, UnpairedFound, pair_count_problems, shard_pairs
from prepack.sources.mixture_stores import StoreChain, open_mixture_stores
from prepack.errors import FormatError, InputError
from prepack.formats.common import Fingerprint, StrictModel, list_column
from prepack.formats.shards import (
    DESIRABLE,
    GROUP_RANKS,
    GROUP_SCORES,
    MANIFEST_NAME,
    SHARD_STORE_KEY,
    STORE_MANIFEST_NAME,
    Manifest,
    PackLayout,
    check_index_shard,
    check_shard,
    pack_layout,
    read_manifest,
    shard_file_problems,
    shard_sha256,
    unit_name,
)
from prepack.building.mixture import PieceCounts, packable_tokens, piece_counts, segment_trained_tokens, trained_segments
from prepack.building import plan_vectorized
from prepack.building.pair_plan import pair_pieces
from prepack.building.plan import DocumentPieces, document_pieces, untrained_documents
from prepack.sources.documents import Documents, Reading, open_documents, store_documents
from prepack.sources.corpus import Corpus, DocumentBatch
from prepack.storage.remote import (
    LocalInput, filesystem, is_uri, join, list_input, local_input, read_output_manifest, storage_errors,
)
from prepack.sources.store import ShardColumns, Store, group_prompt_lengths, is_store, open_build_store

if TYPE_CHECKING:  # tokenizers and jinja2 load only when a source is tokenized again
    from prepack.sources.pairs import GroupValues
from prepack.formats.store import StoreFingerprint, StoreManifest, read_store_manifest

__all__ = ["Problem", "checked_summary", "holds_store", "verify_build", "verify_store", "verify_store_with_summary"]

_COMPARE_TOKENS = 2**22  # tokens compared per step against the source
_RESUME_BLOCK = 1024  # rows checked per call after a failing row, so --all stays linear in the rows


class Problem(StrictModel):
    """One thing wrong with a build. `file` is a shard's name or `manifest.json` (None for the build as
    a whole), or an index build's store file, its path from the build (`../store/documents-00000.arrow`),
    or a file of a store verified on its own, by its name there (`store.json`, `documents-00000.arrow`);
    `row` the pack's row inside that shard (the document's inside a store shard), `column` the shard
    column (or the manifest field);
    `source_file`/`source_row` locate the corpus document concerned, when there is one;
    `location` is the URI of a build in object storage, which `file` is relative to (None for a local
    build, whose files are named relative to its directory): `str()` then names the object's URI."""

    file: str | None = None
    row: int | None = None
    column: str | None = None
    source_file: str | None = None
    source_row: int | None = None
    location: str | None = None
    message: str

    def __str__(self) -> str:
        where = []
        if self.source_file is not None:
            where.append(
                f"source {self.source_file}"
                + (f", row {self.source_row}" if self.source_row is not None else "")
            )
        if self.file is not None:
            where.append(self.file if self.location is None else join(self.location, self.file))
        if self.row is not None:
            where.append(f"row {self.row}")
        if self.column is not None:
            where.append(self.column if self.file == MANIFEST_NAME else f"column {self.column!r}")
        return f"{', '.join(where)}: {self.message}" if where else self.message


def verify_build(
    path: str | os.PathLike,
    source: str | os.PathLike | None = None,
    *,
    tokenizer: str | os.PathLike | None = None,
    chat_template: str | os.PathLike | None = None,
    all_problems: bool = False,
    cache_dir: str | os.PathLike | None = None,
    store: str | os.PathLike | None = None,
) -> list[Problem]:
    """Check the build at `path` (and, with `source`, every token of the corpus it was built from).

    `source` is the corpus, or a document store made from it (`build_store`), whose tokens are then
    compared as they are. A build that tokenized text or chat needs `tokenizer` (and `chat_template`,
    when the build was given one) with a corpus `source`: the source is tokenized again, with the
    manifest's options, and must match the tokenizer and template identities the manifest records.
    An index build's packs are compared with the source as gathered from its store.

    `path` and `source` may be URIs (`s3://bucket/packed`, needs `prepack-llm[s3]`): the build's shards are
    then downloaded into `cache_dir` (`prepack.storage.cache`; when None, a temporary directory deleted before
    this returns) and its problems carry its URI (`Problem.location`); the source is copied into a
    temporary directory while it is read.

    `store`: an index build's store where it lies now (a local directory), instead of the one its
    manifest names; refused (InputError) for a full build.

    Returns the problems found: none for a sound build, the first one only unless `all_problems`.
    Raises FormatError when `path` is not a build at all (no manifest.json) or a source store breaks
    its format, and InputError when the build or the source cannot be
    read or the source does not fit the build's options; those are not findings about the build.
    """
    with ExitStack() as stack:
        if is_uri(path):
            try:
                build: Path | ShardCache = stack.enter_context(build_cache(str(path), cache_dir, fresh=True))
            except FormatError as exc:
                if exc.problem is None:  # no manifest.json: not a build (`read_output_manifest`)
                    raise
                found, location = exc.problem, str(path).rstrip("/")
                return [Problem(file=MANIFEST_NAME, column=found.column, message=found.message, location=location)]
            manifest = build.manifest
        else:
            build = Path(path)
            if not (build / MANIFEST_NAME).is_file():
                read_manifest(build)  # raises the format's "not a finished build" error
            try:
                manifest = read_manifest(build)
            except FormatError as exc:
                return [Problem(file=MANIFEST_NAME, column=exc.problem.column, message=exc.problem.message)]
        if source is not None and manifest.mixture is not None:
            raise InputError(
                f"{path} is a mixture of {len(manifest.mixture.sources)} sources: --source checks a build of one "
                "corpus; a mixture's packs are checked against its sources' counts (prepack verify without --source)."
            )
        documents = (
            None
            if source is None
            else _source_documents(stack.enter_context(local_input(source)), manifest, tokenizer, chat_template)
        )
        if store is not None and manifest.store is None:
            raise InputError(f"{path} is {'a mixture' if manifest.mixture is not None else 'a full build'}; it reads no store named by --store.")
        if manifest.mixture is not None and manifest.mixture.index_only and is_uri(path):
            raise InputError(f"{path} is a mixture's index build, which is read from a local directory only.")
        problems = _problems(build, manifest, documents, store)
        found = list(problems) if all_problems else list(islice(problems, 1))
    if isinstance(build, ShardCache):
        return [problem.model_copy(update={"location": build.uri}) for problem in found]
    return found


def checked_summary(path: str | os.PathLike, source: str | os.PathLike | None) -> str:
    """The line a clean `verify` ends with: what it checked, an index build's store included."""
    manifest = read_output_manifest(str(path)) if is_uri(path) else read_manifest(Path(path))
    checked = ["shards", "manifest"]
    if manifest.mixture is not None:
        checked.append(f"the counts of {len(manifest.mixture.sources)} sources")
    if manifest.store is not None:
        checked = ["index shards", "manifest", "the store's shards and documents"]
    elif manifest.index_of is not None:  # a mixture's
        checked = ["index shards", "manifest", *checked[2:], "the stores' shards and documents"]
    if source is not None:
        checked.append("every token of the source")
    return f"{path}: no problems ({', '.join(checked[:-1])} and {checked[-1]} checked)."


def holds_store(path: str | os.PathLike) -> bool:
    """Whether `path` is a document store, as `verify` tells one from a build: a local directory holding
    store.json (`is_store`), or a prefix in object storage holding that object. Raises InputError when object
    storage cannot be asked."""
    if not is_uri(path):
        return is_store(path)
    fs, prefix = filesystem(str(path))
    try:
        return fs.isfile(f"{prefix.rstrip('/')}/{STORE_MANIFEST_NAME}")
    except storage_errors() as exc:
        raise InputError(f"{path}: cannot be read ({exc}).") from None


def verify_store(path: str | os.PathLike, *, all_problems: bool = False) -> list[Problem]:
    """Check the document store at `path` on its own, as a build of it would read it (schemas/store-format.md):
    store.json valid (else one problem naming it and, where one is to blame, its field); no `.arrow` file it does
    not list; every shard's sha256 and contents, as the loader checks them; then, every shard sound, the
    fingerprint of the documents (of a grown store, chained over its generations) and each generation's, and
    `length_counts` against the shards' documents (documents and tokens: store.json's own checks, with the
    shards' row and token counts); a store of pairs or groups, each group's prompt as a build reads it.

    Problems name the store's files inside it (`documents-00001.arrow`, `store.json`); `path` may be a URI
    (`s3://bucket/store`, needs `prepack-llm[s3]`): its store.json is read first, then its objects are copied into a
    temporary directory (`TMPDIR`) while they are checked, and its problems carry its URI (`Problem.location`).

    Returns the problems found: none for a sound store, the first one only unless `all_problems`. Raises
    FormatError when `path` is no store at all (no store.json), InputError when it cannot be read."""
    return _check_store(path, all_problems)[1]


def verify_store_with_summary(path: str | os.PathLike, *, all_problems: bool = False) -> tuple[list[Problem], str | None]:
    """`verify_store`'s problems and, when there are none, the line a clean `verify` of the store ends with: what it
    checked, from the store.json it checked the store against (read once: a store appended to meanwhile is described
    as it was checked)."""
    manifest, problems = _check_store(path, all_problems)
    if problems:
        return problems, None
    generations = len(manifest.generations or [manifest])
    return [], (f"{path}: no problems (store.json and {len(manifest.shards)} shards checked: {manifest.documents:,} "
                f"documents, {manifest.tokens:,} tokens, {generations} generation{'s' * (generations != 1)}).")


def _check_store(path: str | os.PathLike, all_problems: bool) -> tuple[StoreManifest | None, list[Problem]]:
    """(the store.json the store at `path` was checked against, None when it is invalid; `verify_store`'s problems)."""
    uri = str(path) if is_uri(path) else None
    try:  # first, so that a prefix that is no store is refused before any of its objects is copied
        manifest = read_output_manifest(uri, STORE_MANIFEST_NAME) if uri is not None else read_store_manifest(path)
    except FormatError as exc:
        if exc.problem is None:  # no store.json: not a store
            raise
        return None, [Problem(file=STORE_MANIFEST_NAME, column=exc.problem.column, message=exc.problem.message, location=uri)]
    with local_input(path) as copy:
        problems = _standalone_store_problems(Store(Path(copy.spec), manifest, copy.location))
        found = list(problems) if all_problems else list(islice(problems, 1))
    return manifest, found if copy.location is None else [p.model_copy(update={"location": copy.location}) for p in found]


@dataclass
class _Segments:
    """The documents of the packs that passed the format checks, one entry per segment."""

    rows: np.ndarray  # int64 corpus row
    pieces: np.ndarray  # int64 piece number
    lengths: np.ndarray  # int64 tokens
    starts: np.ndarray  # int64 first token in its holder's token values
    offset: np.ndarray  # int64 first token inside its pack (its cu_seqlens value)
    shard: np.ndarray  # int32 the shard's index in the manifest
    pack: np.ndarray  # int64 row inside the shard
    number: np.ndarray  # int64 1-based document number inside the pack (its segment id)
    source: np.ndarray  # uint16 a mixture's source (`source_ids`), else 0
    # Which copy of its (row, piece) it is: a mixture packs a document up to once per epoch (`_concatenate`).
    copy: np.ndarray  # int64
    # Its trained tokens (`segment_trained_tokens`) in a full build of a mixture counting them, else 0.
    trained: np.ndarray  # int64
    # Where its tokens lie: its shard (a full build) or its store shard (an index build, once
    # `_reference_problems` found it inside its store document: `readable`), by index.
    holder: np.ndarray  # int32
    readable: np.ndarray  # bool


@dataclass
class _Shard:
    name: str
    ids: np.ndarray | None  # the input_ids values, memory-mapped (kept only for the source check)
    labels: np.ndarray | None  # aligned with ids
    segments: _Segments
    group_values: dict[str, np.ndarray] = field(default_factory=dict)  # a group build's scores, ranks: per segment
    desirable: np.ndarray | None = None  # an unpaired build's labels, one a pair of its segments, in order


@dataclass(frozen=True)
class _Packs:
    """The packs as read, which the checks across shards, against a store and against the source all
    compare: their segments in corpus order (`_concatenate`), the shards that passed the format checks,
    the manifest, and whether every shard did (`complete`: else a document missing from the packs may be
    in a shard left out, and the checks that need every pack are skipped)."""

    segments: _Segments
    shards: dict[int, _Shard]
    manifest: Manifest
    complete: bool

    def where(self, i: int) -> dict:
        """Segment `i`'s shard and row in it, as a `Problem`'s `file` and `row`."""
        return {"file": self.shards[int(self.segments.shard[i])].name, "row": int(self.segments.pack[i])}


_Tokens = dict[int, tuple[np.ndarray, np.ndarray | None]]  # holder index -> (token ids, labels or None)
_Columns = dict[int, ShardColumns]  # store shard index -> its columns


def _source_documents(
    source: LocalInput,
    manifest: Manifest,
    tokenizer: str | os.PathLike | None,
    chat_template: str | os.PathLike | None,
) -> Documents:
    """The documents of the build's source, read as the build read them (`open_documents`): a store as
    it was written (a tokenizer or chat template given with it refused), a corpus with the manifest's
    columns, tokenized again with `tokenizer` when the build tokenized it."""
    o = manifest.options
    if is_store(source.spec):
        reading = Reading(tokenizer=tokenizer, chat_template=chat_template)
    elif o.tokenize is None:
        reading = Reading(column=o.column, labels_column=o.labels_column if manifest.has_labels else None)
    elif tokenizer is None:
        raise InputError(
            f"the build tokenized {o.tokenize.mode} with tokenizer {o.tokenize.tokenizer.name!r}: pass that "
            "tokenizer (--tokenizer) to check the source."
        )
    else:
        chat = o.tokenize.mode == "chat"
        kind = None if o.pairs is None else o.pairs.kind
        if kind == "groups":  # a group build: its G is found in the source again
            columns = {"prompt_column": o.pairs.prompt_column, "completions_column": o.pairs.completions_column,
                       "scores_column": o.pairs.scores_column, "ranks_column": o.pairs.ranks_column}
        elif kind == "unpaired":
            columns = {"unpaired": True, **o.pairs.model_dump(include={"prompt_column", "completion_column", "label_column", "kl_seed"})}
        elif o.pairs is not None:
            columns = o.pairs.model_dump(include={"prompt_column", "chosen_column", "rejected_column"})
        else:
            columns = {"train_on": o.tokenize.train_on, "messages_column" if chat else "text_column": o.tokenize.column}
        reading = Reading(
            tokenizer=tokenizer, chat=chat, eos=o.tokenize.eos, chat_template=chat_template,
            pairs=kind == "pairs", groups=kind == "groups",
            **columns
        )
    documents = open_documents(source.spec, reading, None, None, source.location)
    if documents.store is None and o.tokenize is not None:
        for name, given, built in (
            ("tokenizer's sha256", documents.tokenize.tokenizer.sha256, o.tokenize.tokenizer.sha256),  # its name may differ
            ("chat template sha256", documents.tokenize.chat_template_sha256, o.tokenize.chat_template_sha256),
        ):
            if given != built:
                raise InputError(f"the {name} given is {given}, but the build was made with {built}.")
    return documents


def _problems(
    build: Path | ShardCache, manifest: Manifest, source: Documents | None, store_path: str | os.PathLike | None
) -> Iterator[Problem]:
    """The problems of the build in the directory `build`, or in object storage read through the cache `build`."""
    yield from _manifest_problems(manifest)
    local = isinstance(build, Path)
    store, store_columns = None, {}
    if manifest.store is not None:
        try:
            store = open_build_store(build, manifest, store_path) if local or store_path else build.store()
        except FormatError as exc:
            yield Problem(file=MANIFEST_NAME, column="store", message=str(exc))
        else:
            store_columns = yield from _store_problems(store, manifest)
    elif manifest.index_of is not None:  # a mixture's index build: its sources' stores
        try:
            store = open_mixture_stores(build, manifest)
        except FormatError as exc:
            yield Problem(file=MANIFEST_NAME, column="mixture.sources", message=str(exc))
        else:
            store_columns = yield from _stores_problems(store, manifest)
    readable = yield from (_directory_problems(build, manifest) if local else _download_problems(build))
    shards: dict[int, _Shard] = {}
    pairs: PairCounts | None = PairCounts(0, 0, 0, 0) if manifest.pairs is not None else None
    unpaired = UnpairedFound(manifest.totals.documents // 2) if manifest.options.unpaired else None
    for index, (file, check_sha256) in readable.items():
        shard = yield from _shard_problems(file, index, manifest, check_sha256)
        if shard is not None:
            if pairs is not None:
                pairs = yield from _pair_problems(shard, manifest, pairs)
            if unpaired is not None and shard.ids is not None and shard.labels is not None and shard.desirable is not None:
                seg = shard.segments
                unpaired.add(shard.name, seg.rows, seg.pack, seg.number, shard.ids, shard.labels, seg.starts, seg.lengths,
                             shard.desirable)
            if source is None:  # only the source check reads tokens and values again: unmap the shard now
                shard.ids = shard.labels = None
                shard.group_values = {}
            shards[index] = shard
    complete = len(shards) == len(manifest.shards)
    if not complete:
        yield Problem(
            message=f"{len(manifest.shards) - len(shards)} shard(s) could not be read or have malformed "
            "rows (above); the checks that need every pack (documents missing from the packs, piece "
            "numbering, document counts) were skipped."
        )
    elif pairs is not None:
        for field, message in pair_count_problems(manifest.pairs, pairs, manifest.options.overflow):
            yield Problem(file=MANIFEST_NAME, column=f"pairs.{field}", message=message)
        if unpaired is not None:
            yield from (Problem(file=file, row=row, column=column, message=message)
                        for file, row, column, message in unpaired.problems(manifest))
    segments = _concatenate([s.segments for s in shards.values()], manifest.mixture is not None)
    packs = _Packs(segments, shards, manifest, complete)
    yield from _provenance_problems(packs)
    if manifest.mixture is not None:
        pack_numbers = (segments.shard.astype(np.int64) << 40) | segments.pack  # a shard holds fewer than 2**40 packs
        packable, trained = _store_packable(store, manifest, store_columns) if manifest.index_of is not None and store is not None and len(
            store_columns) == len(store.manifest.shards) else (None, None)
        found = mixture_pack_problems(segments, pack_numbers, manifest, packs.where, complete, packable, trained)
        yield from (Problem(**problem) for problem in found)
    if store is not None:
        yield from _reference_problems(packs, store, store_columns)
        if source is None and manifest.mixture is None and len(store_columns) == len(store.manifest.shards):
            # Without a source an index build is held to its store's documents as a full build is to
            # its corpus: every document's pieces, their lengths, the counts; its tokens are the store's.
            own = store_documents(store, list(store_columns.values()))
            yield from _source_problems(own, packs, None)
    if source is not None:
        tokens = (
            {index: (ids, labels) for index, (_, ids, labels) in store_columns.items()}
            if manifest.store is not None
            else {index: (shard.ids, shard.labels) for index, shard in shards.items()}
        )
        yield from _source_problems(source, packs, tokens, unpaired)
        if source.pairs is not None:  # consumed by now: the source's scores and ranks, one a document
            yield from _group_value_problems(source.pairs.group_values(), shards)


# 1. The manifest's arithmetic ---------------------------------------------------------------------


def _manifest_problems(manifest: Manifest) -> Iterator[Problem]:
    t, o = manifest.totals, manifest.options
    left_out = t.untrained if o.drop_untrained else 0  # documents with no trained token, not packed
    left_out_tokens = t.untrained_tokens if o.drop_untrained else 0
    expected = {
        "documents": sum(f.rows for f in manifest.inputs) if manifest.mixture is None else sum(s.documents for s in manifest.mixture.sources),
        "packs": sum(s.rows for s in manifest.shards),
        "tokens": sum(s.tokens for s in manifest.shards),
        "padding_tokens": t.packs * o.max_len - t.tokens,
        "lower_bound": -(-t.tokens // o.max_len),
        "segments": t.documents - t.empty - t.split - t.dropped + t.split_pieces - left_out,
        "input_tokens": t.tokens + t.truncated_tokens + t.dropped_tokens + left_out_tokens,
    }
    why = {
        "documents": "the sum of inputs[].rows" if manifest.mixture is None else "the sum of mixture.sources[].documents",
        "packs": "the sum of shards[].rows",
        "tokens": "the sum of shards[].tokens",
        "padding_tokens": "packs * max_len - tokens",
        "lower_bound": "ceil(tokens / max_len)",
        "segments": "documents - empty - split - dropped + split_pieces (- untrained with drop_untrained)",
        "input_tokens": "tokens + truncated_tokens + dropped_tokens (+ untrained_tokens with drop_untrained)",
    }
    for name, value in expected.items():
        said = getattr(t, name)
        if said != value:
            yield Problem(
                file=MANIFEST_NAME, column=f"totals.{name}", message=f"is {said}, but {why[name]} is {value}."
            )
    if manifest.mixture is not None:
        yield from (Problem(**found) for found in mixture_manifest_problems(manifest))
    if manifest.store is not None and manifest.store.fingerprint != manifest.fingerprint:
        yield Problem(
            file=MANIFEST_NAME,
            column="store.fingerprint",
            message=f"is {manifest.store.fingerprint}, but the build was planned from the documents of "
            f"fingerprint {manifest.fingerprint}: the manifest names another store than its own.",
        )
    allowed = {"split": ("split", "error"), "truncated": ("truncate",), "dropped": ("drop",)}
    for name, policies in allowed.items():
        if getattr(t, name) and o.overflow not in policies:
            yield Problem(
                file=MANIFEST_NAME,
                column=f"totals.{name}",
                message=f"is {getattr(t, name)}, but overflow {o.overflow!r} never does that.",
            )
    if t.split_pieces < 2 * t.split or (t.split == 0) != (t.split_pieces == 0):
        yield Problem(
            file=MANIFEST_NAME,
            column="totals.split_pieces",
            message=f"is {t.split_pieces} for {t.split} split documents; each split gives at least 2 pieces.",
        )
    if o.tokenize is None and manifest.has_labels != (o.labels_column is not None):
        yield Problem(
            file=MANIFEST_NAME,
            column="has_labels",
            message=f"is {manifest.has_labels}, but options.labels_column is {o.labels_column!r}.",
        )
    # A tokenizing build makes labels itself, from chat with assistant-only training, and reads none.
    # So does a preference-pair build, whose labels are the completions.
    made_labels = o.tokenize is not None and (
        (o.tokenize.mode == "chat" and o.tokenize.train_on == "assistant") or o.pairs is not None
    )
    if o.tokenize is not None and (manifest.has_labels != made_labels or o.labels_column is not None):
        yield Problem(
            file=MANIFEST_NAME,
            column="has_labels",
            message=f"is {manifest.has_labels} with labels_column {o.labels_column!r}, but a build that "
            f"tokenized {o.tokenize.mode} with train_on {o.tokenize.train_on!r} makes "
            f"{'labels' if made_labels else 'none'} and reads no labels column.",
        )
    yield from _pair_count_problems(manifest)


def _pair_count_problems(manifest: Manifest) -> Iterator[Problem]:
    """A preference-pair build's `pairs` against its totals (schemas/shard-format.md, "Preference-pair builds")."""
    t, p = manifest.totals, manifest.pairs
    if (p is None) != (manifest.options.pairs is None):
        yield Problem(file=MANIFEST_NAME, column="pairs", message="and options.pairs must be both set or both absent.")
        return
    if p is None:
        return
    size = manifest.options.pairs.size
    times, unit = "twice" if size == 2 else f"{size} times", unit_name(size)
    rules = {
        "pairs": (size * p.pairs, t.documents, f"{times} the {unit}s are totals.documents"),
        "dropped": (size * p.dropped, t.dropped, f"{times} the dropped {unit}s are totals.dropped"),
        "prompt_tokens": (p.prompt_tokens + p.completion_tokens, t.tokens, "prompt and completion tokens make totals.tokens"),
        "truncated": (min(max(t.truncated, p.truncated), size * p.truncated), t.truncated,
                      f"each truncated {unit} cuts one or more of its documents (totals.truncated)" if size > 2 else
                      "each truncated pair cuts one or both of its documents (totals.truncated)"),
    }
    for name, (found, said, rule) in rules.items():
        if found != said:
            yield Problem(file=MANIFEST_NAME, column=f"pairs.{name}", message=f"is {getattr(p, name)}, but {rule}: {said}.")
    if manifest.options.overflow == "split":
        yield Problem(file=MANIFEST_NAME, column="options.overflow", message="is 'split', which never applies to pairs.")
    unpaired = manifest.options.unpaired
    if (p.desirable is not None, p.undesirable is not None) != (unpaired, unpaired):
        yield Problem(file=MANIFEST_NAME, column="pairs.desirable", message="and pairs.undesirable are set in an unpaired "
                      "build's manifest (options.pairs.label_column), and only there.")
    elif unpaired and p.desirable + p.undesirable != p.pairs - p.dropped:
        yield Problem(file=MANIFEST_NAME, column="pairs.desirable", message=f"is {p.desirable} and pairs.undesirable "
                      f"{p.undesirable}, but the examples packed are pairs - dropped: {p.pairs - p.dropped}.")


def _pair_problems(shard: _Shard, manifest: Manifest, counts: PairCounts):
    """Yield the problems of a pair build's shard that only its tokens show (`shard_pairs`: each document a
    prompt labelled -100 then its completion, the two of a pair sharing their prompt tokens); return
    `counts` with the shard's added, or None when the shard carries no labels to count them by (its
    manifest's has_labels is then reported)."""
    if shard.ids is None or shard.labels is None:
        return None
    seg = shard.segments
    found, problems = shard_pairs(shard.ids, shard.labels, seg.starts, seg.lengths, manifest.options.max_len,
                                  manifest.options.pairs.size, shard.desirable)
    for document, column, message in problems:
        yield Problem(file=shard.name, row=int(seg.pack[document]), column=column, message=f"document {seg.number[document]} {message}")
    return counts.add(found)


# 2. The directory ---------------------------------------------------------------------------------


_SHARD_FILES = "shard-*.arrow"  # what a file the manifest does not list is taken for a shard by
_STORE_FILES = "*.arrow"  # and in a store, which holds its shards and store.json, nothing else


def _unlisted_problems(names: list[str], manifest: Manifest | StoreManifest, shard_files: str = _SHARD_FILES) -> Iterator[Problem]:
    """The shard files (by the pattern `shard_files`) among `names` (the files at the top of the build, or of a
    store) that the manifest does not list."""
    listed = {info.name for info in manifest.shards}
    for extra in sorted(n for n in names if fnmatchcase(n, shard_files) and n not in listed):
        yield Problem(file=extra, message="a shard file the manifest does not list.")


_Readable = dict[int, tuple[Path, bool]]  # shard index -> (its local file, whether its sha256 is still to check)


def _directory_problems(path: Path, manifest: Manifest):
    """Yield the directory's problems (`shard_file_problems`, and shards the manifest does not list);
    return the shards there are files to read: those of the wrong size, their sha256 not to check."""
    found = {}
    for problem in shard_file_problems(path, manifest):
        found[problem.index] = problem.kind
        column = f"shards[{problem.index}].name" if problem.kind == "name" else None
        yield Problem(file=problem.file, column=column, message=problem.message)
    yield from _unlisted_problems([p.name for p in path.glob(_SHARD_FILES)], manifest)
    readable: _Readable = {}
    for index, info in enumerate(manifest.shards):
        if found.get(index) not in ("name", "missing", "type"):
            readable[index] = (path / info.name, index not in found)
    return readable


def _download_problems(cache: ShardCache):
    """Yield the problems of a build in object storage's shards as the cache downloads them (missing,
    size, sha256: `ShardCache.fetch`, which keeps no copy that fails), and the shards it does not list;
    return the shards the cache holds, their sha256 checked."""
    readable: _Readable = {}
    for index, info in enumerate(cache.manifest.shards):
        try:
            readable[index] = (cache.shard(info), False)
        except FormatError as exc:
            yield Problem(file=info.name, message=exc.problem.message)
    # The prefix's objects at its top, as `list_input` finds them (`.arrow` objects among others).
    yield from _unlisted_problems([n for n in list_input(cache.uri).names if "/" not in n], cache.manifest)
    return readable


# 2b. An index build's store --------------------------------------------------------------------


def _store_problems(store: Store, manifest: Manifest):
    """Yield the problems of an index build's store: each shard's sha256 and contents, as the loader
    checks them (`Store.shard_columns`), the fingerprint of its documents (every token) against its
    manifest's, which `open_build_store` held to the build's, and its documents and corpus files
    against the build's. Return {store shard index: its columns} of the sound shards."""
    m, where = store.manifest, manifest.store.path
    if m.documents != manifest.totals.documents:
        yield Problem(
            file=MANIFEST_NAME,
            column="totals.documents",
            message=f"is {manifest.totals.documents}, but its store {where!r} holds {m.documents} documents.",
        )
    if [(f.path, f.rows) for f in m.inputs] != [(f.path, f.rows) for f in manifest.inputs]:
        yield Problem(file=MANIFEST_NAME, column="inputs", message=f"are not the corpus files of its store {where!r}.")
    columns = yield from _store_document_problems(store, where, manifest)
    if len(columns) < len(m.shards):
        yield Problem(
            message=f"{len(m.shards) - len(columns)} shard(s) of the store {where!r} could not be read or are "
            "damaged (above): the packs were not checked against the store's documents, and no token was "
            "read from those shards."
        )
    return columns


def _store_file(where: str | None, name: str) -> str:
    """What problems name a store's file `name` by: its path from the build (`where`, the store's path from it),
    or, for a store verified on its own (`where` None), its name inside the store."""
    return name if where is None else f"{where}/{name}"


def _store_document_problems(store: Store, where: str | None, manifest: Manifest | None = None):
    """Yield the problems of a store's shards and of what its `store.json` says of their documents: each shard's
    sha256 and contents, as the loader checks them (`Store.shard_columns`), and, when every shard is sound, the
    fingerprint of its documents (every token) against its manifest's, each generation's fingerprint (and those
    its grown index build's `manifest` records) and its `length_counts`. Files are named from `where`
    (`_store_file`). Return {store shard index: its columns} of the sound shards; the caller says what the
    others left unchecked."""
    m = store.manifest
    columns: _Columns = {}
    fingerprint = StoreFingerprint(m)  # of a grown store: chained over its generations
    length_counts = []  # each shard's (lengths, how many documents have each)
    for index, shard in enumerate(m.shards):
        try:
            offsets, ids, labels = columns[index] = store.shard_columns(shard)
        except FormatError as exc:
            found = exc.problem
            yield Problem(file=_store_file(where, shard.name), row=found.row, column=found.column, message=found.message)
        else:
            fingerprint.update(lengths := np.diff(offsets), ids, labels)
            length_counts.append(np.unique(lengths, return_counts=True))
    if len(columns) < len(m.shards):
        return columns
    if (digest := fingerprint.hexdigest()) != m.fingerprint:
        yield Problem(
            file=_store_file(where, STORE_MANIFEST_NAME),
            column="fingerprint",
            message=f"is {m.fingerprint}, but the store's documents give {digest}: they changed after the store "
            "was written.",
        )
    else:
        yield from _generation_fingerprint_problems(fingerprint.found, m, manifest, where)
        yield from _length_counts_problems(length_counts, m, where)
    return columns


def _standalone_store_problems(store: Store) -> Iterator[Problem]:
    """The problems of a store verified on its own (`verify_store`), its files named inside it: `.arrow` files its
    store.json does not list, then its shards and what store.json says of their documents
    (`_store_document_problems`), and of a store of pairs or groups, each group's prompt in its labels as a
    build reads it (`group_prompt_lengths`)."""
    m = store.manifest
    yield from _unlisted_problems([p.name for p in store.root.glob(_STORE_FILES)], m, _STORE_FILES)
    columns = yield from _store_document_problems(store, None)
    if len(columns) < len(m.shards):
        yield Problem(
            message=f"{len(m.shards) - len(columns)} shard(s) could not be read or are damaged (above): the "
            f"store's fingerprint, generations and length_counts were not checked against its documents."
        )
    if m.pairs is not None:
        without_numba = plan_vectorized.labels_in_numpy(m.tokens)
        for index, (offsets, _, labels) in columns.items():
            try:
                group_prompt_lengths(offsets, labels, m.pairs.size, m.shards[index].name, without_numba=without_numba)
            except FormatError as exc:
                found = exc.problem
                yield Problem(file=m.shards[index].name, row=found.row, column=found.column, message=found.message)


def _length_counts_problems(shard_counts: list[tuple[np.ndarray, np.ndarray]], m: StoreManifest, where: str | None):
    """Yield a problem when a grown store's `store.json` (`m`) records other `length_counts` than its
    shards' documents give (`shard_counts`: each shard's lengths and their counts): its model holds them to
    the store's documents and tokens only, and the next store append summarises its lengths from them."""
    if m.length_counts is None:
        return
    lengths, where_in = np.unique(np.concatenate([values for values, _ in shard_counts]), return_inverse=True)
    counts = np.zeros(len(lengths), np.int64)
    np.add.at(counts, where_in, np.concatenate([c for _, c in shard_counts]))
    if np.column_stack([lengths, counts]).tolist() != m.length_counts:
        yield Problem(
            file=_store_file(where, STORE_MANIFEST_NAME),
            column="length_counts",
            message="are not the lengths of the store's documents (how many documents have each, by rising length).",
        )


def _generation_fingerprint_problems(found: list[str], m: StoreManifest, manifest: Manifest | None, where: str | None):
    """Yield each generation fingerprint that a grown store's `store.json` (`m`) or its grown build
    (`manifest`, None for a store verified on its own) records and the store's documents (`found`: each
    generation's, recomputed) do not give: the chained last one checks none of those before it."""
    for number, generation in enumerate((m.generations or [])[:-1]):
        if generation.fingerprint != found[number]:
            yield Problem(
                file=_store_file(where, STORE_MANIFEST_NAME),
                column=f"generations[{number}].fingerprint",
                message=f"is {generation.fingerprint}, but the documents of generation {number} give {found[number]}.",
            )
    ends = [g.documents for g in m.generations] if m.generations is not None else [m.documents]
    for number, generation in enumerate((manifest.generations if manifest is not None else None) or []):
        given = found[ends.index(generation.documents)] if generation.documents in ends else None
        if generation.fingerprint != given:
            yield Problem(
                file=MANIFEST_NAME,
                column=f"generations[{number}].fingerprint",
                message=f"is {generation.fingerprint}, but the store's documents up to its {generation.documents} "
                f"give {given or 'no generation of the store'}.",
            )


def _stores_problems(chain: StoreChain, manifest: Manifest):
    """`_store_problems` for a mixture's index build: each source's store (opened by `open_mixture_stores`,
    which held it to the source's fingerprint and rows), its shards' sha256 and contents, the fingerprint
    of its documents, its corpus files against the source's `inputs`. Return {chain shard index: its columns}."""
    columns: _Columns = {}
    index = 0
    for store, source in zip(chain.stores, manifest.mixture.sources):
        m, where = store.manifest, source.store
        named = [(f.path, f.rows) for f in manifest.inputs if f.path.startswith(f"{source.name}/")]
        if [(f"{source.name}/{f.path}", f.rows) for f in m.inputs] != named:
            yield Problem(file=MANIFEST_NAME, column="inputs", message=f"are not the corpus files of source {source.name!r}'s store {where!r}.")
        fingerprint, sound = Fingerprint(), True
        for shard in m.shards:
            try:
                offsets, ids, labels = columns[index] = chain.shard_columns(shard)
            except FormatError as exc:
                found, sound = exc.problem, False
                yield Problem(file=f"{where}/{shard.name}", row=found.row, column=found.column, message=found.message)
            else:
                fingerprint.update(np.diff(offsets), ids, labels if m.has_labels else None)
            index += 1
        if sound and (digest := fingerprint.hexdigest()) != m.fingerprint:
            yield Problem(
                file=f"{where}/{STORE_MANIFEST_NAME}",
                column="fingerprint",
                message=f"is {m.fingerprint}, but the store's documents give {digest}: they changed after the store was written.",
            )
    if len(columns) < len(chain.manifest.shards):
        yield Problem(
            message=f"{len(chain.manifest.shards) - len(columns)} shard(s) of the sources' stores could not be read or "
            "are damaged (above): the packs were not checked against those shards' documents."
        )
    return columns


def _store_packable(chain: StoreChain, manifest: Manifest, columns: _Columns) -> tuple[list[np.ndarray], list[PieceCounts] | None]:
    """Each source's documents' packable tokens, from its store as the build read it (`packable_tokens` of
    its lengths and untrained flags), for a mixture's index build whose stores' shards are sound (`columns`:
    every chain shard's, checked by `_stores_problems`); and where the mixture counts trained tokens, each
    source's `PieceCounts`, from its stores' labels (`trained_segments`)."""
    o = manifest.options
    packable, trained = [], [] if manifest.mixture.count is not None else None
    first = 0
    for store in chain.stores:
        shards = range(first, first + len(store.manifest.shards))
        first = shards.stop
        # The store's own labels: the chain serves a store without labels its token ids as labels.
        parts = [(columns[k][0], columns[k][2] if store.manifest.has_labels else None) for k in shards]
        lengths = np.concatenate([np.diff(offsets) for offsets, _ in parts]) if parts else np.zeros(0, np.int64)
        untrained = np.concatenate([untrained_documents(offsets, labels) for offsets, labels in parts]) if parts else np.zeros(0, bool)
        packable.append(packable_tokens(lengths, untrained, o.max_len, o.overflow, o.drop_untrained))
        if trained is not None:
            trained.append(piece_counts([trained_segments(offsets, labels, o.max_len, o.overflow) for offsets, labels in parts]))
    return packable, trained


def _reference_problems(packs: _Packs, store: Store, columns: _Columns) -> Iterator[Problem]:
    """Every segment of an index build lies inside its store document: tokens piece * max_len onwards,
    as many as `cu_seqlens` says. Sets where those tokens are (`seg.holder`, `seg.starts`) and, for
    those inside a sound store shard, `seg.readable`."""
    seg, max_len = packs.segments, packs.manifest.options.max_len
    documents = np.array([s.documents for s in store.manifest.shards], dtype=np.int64)
    ends = np.cumsum(documents)
    # The segments are in corpus (= store) order: each store shard's are a run.
    bounds = np.searchsorted(seg.rows, np.append(0, ends), "left")
    seg.holder = (np.searchsorted(ends, seg.rows, "right")).astype(np.int32)
    seg.readable = np.zeros(len(seg.rows), dtype=bool)
    for index, (offsets, _, _) in columns.items():
        run = slice(int(bounds[index]), int(bounds[index + 1]))
        local = seg.rows[run] - (ends[index] - documents[index])
        first = offsets[local] + seg.pieces[run] * max_len
        inside = first + seg.lengths[run] <= offsets[local + 1]
        seg.starts[run], seg.readable[run] = first, inside
        for k in np.flatnonzero(~inside):
            i, length = run.start + k, offsets[local[k] + 1] - offsets[local[k]]
            yield Problem(
                **packs.where(i),
                column="source_pieces",
                message=f"document {seg.number[i]} (store document {seg.rows[i]}, piece {seg.pieces[i]}, "
                f"{seg.lengths[i]} tokens) runs past that document's {length} tokens.",
            )


# 3. Each shard ------------------------------------------------------------------------------------


def _shard_problems(file: Path, index: int, manifest: Manifest, check_sha256: bool):
    """Yield the problems of shard `index`, read from `file` (its sha256 only if `check_sha256`);
    return its segments when its rows can be trusted, else None."""
    info = manifest.shards[index]
    name = info.name
    try:
        if check_sha256 and (digest := shard_sha256(file)) != info.sha256:
            yield Problem(
                file=name,
                message=f"sha256 is {digest}, but the manifest says {info.sha256}: the file changed after "
                "the build.",
            )
        index_only = manifest.index_of is not None
        batch = manifest.open_shard(file)
        batch.validate(full=True)
        yield from _generation_problems(batch, index, manifest)
    except FormatError as exc:
        yield Problem(file=name, row=exc.problem.row, column=exc.problem.column, message=exc.problem.message)
        return None
    except pa.ArrowException as exc:
        yield Problem(file=name, message=f"not valid Arrow data ({exc}).")
        return None
    if batch.num_rows != info.rows:
        yield Problem(file=name, message=f"{batch.num_rows} packs, but the manifest says {info.rows}.")
    if not index_only and (tokens := len(batch.column("input_ids").flatten())) != info.tokens:
        yield Problem(
            file=name, column="input_ids", message=f"{tokens} tokens, but the manifest says {info.tokens}."
        )
    sound = True
    for problem in _row_problems(batch, manifest.options.max_len, name, index_only):
        sound = False
        yield problem
    if not sound:
        return None
    counts_trained = manifest.mixture is not None and manifest.mixture.count is not None and not index_only
    shard = _read_segments(batch, name, index, counts_trained)
    if DESIRABLE in batch.schema.names:
        offsets, values = list_column(batch, DESIRABLE, name)
        shard.desirable = np.asarray(values[offsets[0] : offsets[-1]], bool)
    if index_only and (tokens := int(shard.segments.lengths.sum())) != info.tokens:
        yield Problem(file=name, column="cu_seqlens", message=f"{tokens} tokens, but the manifest says {info.tokens}.")
    yield from _value_problems(shard, manifest)
    return shard


def _generation_problems(batch: pa.RecordBatch, index: int, manifest: Manifest) -> Iterator[Problem]:
    """An index shard of a build grown by appends names the store fingerprint of its own generation
    (`open_shard` accepts any of the build's)."""
    if manifest.store is None or manifest.generations is None:
        return
    generation = manifest.generation_of_shard(index)
    planned = batch.schema.metadata[SHARD_STORE_KEY.encode()].decode()
    if planned != (wanted := manifest.generations[generation].fingerprint):
        yield Problem(
            file=manifest.shards[index].name,
            message=f"was planned from the store of fingerprint {planned}, but it is a shard of generation "
            f"{generation}, planned from {wanted}.",
        )


def _row_problems(batch: pa.RecordBatch, max_len: int, name: str, index_only: bool) -> Iterator[Problem]:
    """`check_shard`'s findings (`check_index_shard`'s for an index shard): its first one, then, while
    the caller asks for more, the first one after that row, and so on (in blocks, so many bad rows do
    not make this quadratic)."""
    check = check_index_shard if index_only else check_shard
    start, length = 0, batch.num_rows
    while start < batch.num_rows:
        try:
            check(batch.slice(start, length), max_len, name)
        except FormatError as exc:
            found = exc.problem
            if found.row is None:
                yield Problem(file=name, column=found.column, message=found.message)
                return
            yield Problem(file=name, row=start + found.row, column=found.column, message=found.message)
            start += found.row + 1
        else:
            start += length
        length = _RESUME_BLOCK


def _list_values(batch: pa.RecordBatch, column: str) -> tuple[np.ndarray, np.ndarray]:
    """`list_column` with int64 offsets, for arithmetic with the int64 corpus rows."""
    offsets, values = list_column(batch, column)
    return offsets.astype(np.int64), values


def _read_segments(batch: pa.RecordBatch, name: str, index: int, counts_trained: bool = False) -> _Shard:
    """The shard's segments; with `counts_trained` (a full build of a mixture counting trained tokens), each
    one's trained tokens from the labels (`_Segments.trained`)."""
    src_off, rows = _list_values(batch, "source_rows")
    piece_off, pieces = _list_values(batch, "source_pieces")
    layout: PackLayout = pack_layout(*list_column(batch, "cu_seqlens"))
    # input_ids' offsets run from 0 (open_shard) with the packs' lengths (check_shard): they are these.
    pack_starts = np.cumsum(layout.tokens) - layout.tokens
    names = batch.schema.names
    labels = list_column(batch, "labels")[1] if "labels" in names else None
    starts = pack_starts[layout.pack] + layout.starts
    group_values = {}  # a group build's, one a segment in shard order, as source_rows
    for column in (c for c in (GROUP_SCORES, GROUP_RANKS) if c in names):
        offsets, found = _list_values(batch, column)
        group_values[column] = found[offsets[0] : offsets[-1]]
    return _Shard(
        name=name,
        ids=list_column(batch, "input_ids")[1] if "input_ids" in names else None,
        labels=labels,
        group_values=group_values,
        segments=_Segments(
            source=(
                list_column(batch, "source_ids")[1][src_off[0] : src_off[-1]]
                if "source_ids" in names
                else np.zeros(src_off[-1] - src_off[0], np.uint16)
            ),
            copy=np.zeros(src_off[-1] - src_off[0], np.int64),
            trained=(
                segment_trained_tokens(labels, starts, layout.lengths).astype(np.int64)
                if counts_trained
                else np.zeros(len(layout.pack), np.int64)
            ),
            rows=rows[src_off[0] : src_off[-1]].astype(np.int64),
            pieces=pieces[piece_off[0] : piece_off[-1]].astype(np.int64),
            lengths=layout.lengths,
            starts=starts,
            offset=layout.starts,
            shard=np.full(len(layout.pack), index, dtype=np.int32),
            pack=layout.pack,
            number=layout.number,
            holder=np.full(len(layout.pack), index, dtype=np.int32),
            readable=np.full(len(layout.pack), "input_ids" in names),
        ),
    )


def _value_problems(shard: _Shard, manifest: Manifest) -> Iterator[Problem]:
    """What `check_shard` cannot know: provenance against the corpus size and order inside a pack."""
    name, seg = shard.name, shard.segments
    documents = manifest.totals.documents if manifest.mixture is None else sum(f.rows for f in manifest.inputs)
    for i in np.flatnonzero((seg.rows < 0) | (seg.rows >= documents)):
        yield Problem(
            file=name,
            row=int(seg.pack[i]),
            column="source_rows",
            message=f"document {seg.number[i]} comes from corpus row {seg.rows[i]}; the corpus has "
            f"{documents} rows.",
        )
    same_pack = seg.pack[1:] == seg.pack[:-1]
    ordered = (seg.rows[1:] > seg.rows[:-1]) | (
        (seg.rows[1:] == seg.rows[:-1]) & (seg.pieces[1:] > seg.pieces[:-1])
    )
    for i in np.flatnonzero(same_pack & ~ordered) + 1:
        yield Problem(
            file=name,
            row=int(seg.pack[i]),
            column="source_rows",
            message=f"document {seg.number[i]} (corpus row {seg.rows[i]}, piece {seg.pieces[i]}) follows "
            f"(row {seg.rows[i - 1]}, piece {seg.pieces[i - 1]}); documents in a pack are in (row, piece) "
            "order.",
        )
    if (cap := manifest.options.max_docs_per_pack) is not None:
        held = np.bincount(seg.pack, minlength=1)
        for pack in np.flatnonzero(held > cap):
            yield Problem(
                file=name,
                row=int(pack),
                column="cu_seqlens",
                message=f"{held[pack]} documents, more than the manifest's max_docs_per_pack = {cap}.",
            )


# 4. Across shards ---------------------------------------------------------------------------------


def _concatenate(parts: list[_Segments], copies: bool) -> _Segments:
    """All segments in corpus order; with `copies` (a mixture, which packs a document once per epoch),
    each numbered by which copy of its (row, piece) it is, and in (row, copy, piece) order: a copy then
    stands for a document of its own."""
    fields = _Segments.__dataclass_fields__
    if not parts:
        return _Segments(**{f: np.empty(0, np.int64) for f in fields})
    joined = {f: np.concatenate([getattr(p, f) for p in parts]) for f in fields}
    order = np.lexsort((joined["pieces"], joined["rows"]))  # corpus order
    joined = {f: v[order] for f, v in joined.items()}
    if copies:
        joined["copy"] = copy_numbers(joined["rows"], joined["pieces"])
        order = np.lexsort((joined["pieces"], joined["copy"], joined["rows"]))
        joined = {f: v[order] for f, v in joined.items()}
    return _Segments(**joined)


def _provenance_problems(packs: _Packs) -> Iterator[Problem]:
    """Cross-shard provenance; with shards missing (`complete` False), only what those cannot change."""
    seg, manifest, complete = packs.segments, packs.manifest, packs.complete
    t, max_len = manifest.totals, manifest.options.max_len
    same_row = (seg.rows[1:] == seg.rows[:-1]) & (seg.copy[1:] == seg.copy[:-1])  # one document (copy)
    duplicate = same_row & (seg.pieces[1:] == seg.pieces[:-1])
    for i in np.flatnonzero(duplicate) + 1:
        first = packs.where(i - 1)
        yield Problem(
            **packs.where(i),
            column="source_rows",
            message=f"corpus row {seg.rows[i]}, piece {seg.pieces[i]} is also in {first['file']} row "
            f"{first['row']}; every document is in exactly one pack.",
        )
    expected_piece = np.zeros(len(seg.rows), dtype=np.int64)
    expected_piece[1:] = np.where(same_row, seg.pieces[:-1] + 1, 0)
    gap = (seg.pieces != expected_piece) & complete  # the piece before may be in a missing shard
    gap[1:] &= ~duplicate
    for i in np.flatnonzero(gap):
        yield Problem(
            **packs.where(i),
            column="source_pieces",
            message=f"corpus row {seg.rows[i]} has piece {seg.pieces[i]} where piece {expected_piece[i]} "
            "should be; the pieces of a split document are numbered 0, 1, … without gaps.",
        )
    if manifest.options.overflow in ("truncate", "drop"):
        for i in np.flatnonzero(seg.pieces > 0):
            yield Problem(
                **packs.where(i),
                column="source_pieces",
                message=f"piece {seg.pieces[i]} of corpus row {seg.rows[i]}, but overflow "
                f"{manifest.options.overflow!r} never splits.",
            )
    not_last = np.append(same_row & ~duplicate, False)
    for i in np.flatnonzero(not_last & (seg.lengths != max_len)):
        yield Problem(
            **packs.where(i),
            column="cu_seqlens",
            message=f"piece {seg.pieces[i]} of corpus row {seg.rows[i]} has {seg.lengths[i]} tokens; every "
            f"piece but a split document's last holds max_len = {max_len}.",
        )
    if not complete:
        return
    row_starts = np.flatnonzero(np.append(True, ~same_row))
    pieces_per_row = np.diff(np.append(row_starts, len(seg.rows)))
    packed_rows = "documents - empty - dropped" + (" - untrained" if manifest.options.drop_untrained else "")
    found = {
        "segments": len(seg.rows),
        packed_rows: len(row_starts),
        "split": int((pieces_per_row > 1).sum()),
        "split_pieces": int(pieces_per_row[pieces_per_row > 1].sum()),
    }
    said = {
        "segments": t.segments,
        packed_rows: t.documents - t.empty - t.dropped - (t.untrained if manifest.options.drop_untrained else 0),
        "split": t.split,
        "split_pieces": t.split_pieces,
    }
    for name, value in found.items():
        if value != said[name]:
            yield Problem(
                file=MANIFEST_NAME,
                column=f"totals.{name}" if " " not in name else "totals",
                message=f"{name} is {said[name]}, but the packs hold {value}.",
            )
    if manifest.segment_lengths is None:
        return
    # By np.unique, not a bincount: an index shard's segment may claim up to max_len tokens it does not hold.
    held = np.stack(np.unique(seg.lengths, return_counts=True), axis=1).tolist()
    if manifest.segment_lengths != held:
        differ = next((a, b) for a, b in zip(manifest.segment_lengths + [None], held + [None]) if a != b)
        yield Problem(
            file=MANIFEST_NAME,
            column="segment_lengths",
            message=f"records {differ[0] or 'no more'} ([length, count]) where the packs hold {differ[1] or 'no more'}: "
            "an append would count a rebuild's packs from segments the build does not have.",
        )


# 5. Against the source ----------------------------------------------------------------------------


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated [start, start + length) index ranges."""
    before = np.cumsum(lengths) - lengths
    return np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def _source_problems(source: Documents, packs: _Packs, tokens: _Tokens | None, unpaired: UnpairedFound | None = None) -> Iterator[Problem]:
    """The packs against the source's documents; their tokens too, read from `tokens`, unless None; an unpaired
    build's labels (`unpaired`, as its shards hold them) against the source's."""
    seg, manifest = packs.segments, packs.manifest
    o = manifest.options
    corpus, batches = source.corpus, source.batches
    if manifest.has_labels and not source.has_labels:
        yield Problem(
            source_file=corpus.name(corpus.files[0]),
            column=o.labels_column,
            message=f"the build carries labels from column {o.labels_column!r}, the source has none; "
            "labels are not compared.",
        )
    counts = Counter(documents=0, **document_pieces([], o.max_len, o.overflow).counts)  # every key, at 0
    pairs = Counter()  # a pair build's `PairTotals` fields
    rows_per_file = {path: 0 for path in corpus.files}
    row0 = 0
    for batch in batches:
        m = len(batch.offsets) - 1
        untrained = untrained_documents(batch.offsets, batch.labels if manifest.has_labels else None)
        if source.pairs is not None:  # pairs are cut as units (`prepack.building.pair_plan`)
            prompts = source.pairs.latest_prompt_lengths()
            expected, pair_counts = pair_pieces(np.diff(batch.offsets), prompts, o.max_len, o.overflow, untrained,
                                                source.pairs.options.size)
            pairs.update(pair_counts)
        else:
            expected = document_pieces(np.diff(batch.offsets), o.max_len, o.overflow, untrained, o.drop_untrained)
        counts.update(documents=m, **expected.counts)
        yield from _batch_problems(corpus, batch, expected, row0, packs, tokens)
        if unpaired is not None and source.pairs is not None and source.pairs.desirable is not None:
            for example, file, row, column, message in unpaired.label_problems(row0 // 2, source.pairs.desirable[row0 // 2 : (row0 + m) // 2]):
                yield Problem(file=file, row=row, column=column, message=message, source_file=corpus.name(batch.file),
                              source_row=example - (row0 - rows_per_file[batch.file]) // 2)
        rows_per_file[batch.file] += m
        row0 += m
    for i in np.flatnonzero(seg.rows >= row0):
        yield Problem(
            **packs.where(i),
            column="source_rows",
            message=f"holds corpus row {seg.rows[i]}, but the source has {row0} rows.",
        )
    inputs = [(corpus.name(path), rows) for path, rows in rows_per_file.items()]
    listed = [(f.path, f.rows) for f in manifest.inputs]
    if inputs != listed:
        yield Problem(
            file=MANIFEST_NAME,
            column="inputs",
            message=f"lists (file, rows) {listed}, the source has {inputs}.",
        )
    # An unpaired build's label counts are held to its shards' labels, and those to the source's (above).
    said_pairs = manifest.pairs.model_dump(exclude={"desirable", "undesirable"}) if manifest.pairs is not None and source.pairs is not None else {}
    for key, value in [*((f"totals.{k}", v) for k, v in counts.items()), *((f"pairs.{k}", pairs[k]) for k in said_pairs)]:
        section, name = key.split(".")
        said = getattr(manifest.totals, name) if section == "totals" else said_pairs[name]
        if said != value:
            yield Problem(
                file=MANIFEST_NAME,
                column=key,
                message=f"is {said}, but the source with max_len {o.max_len} and overflow {o.overflow!r} "
                f"gives {value}.",
            )


def _group_value_problems(values: GroupValues, shards: dict[int, _Shard]) -> Iterator[Problem]:
    """A group build's stored scores and ranks against the source's (`values`, `GroupValues`: one a corpus
    document): each document's must be its corpus row's. A finite value changed in a shard whose sha256 was
    recorded again passes every format check; only the source tells it."""
    for column, expected in ((GROUP_SCORES, values.scores), (GROUP_RANKS, values.ranks)):
        for shard in (s for s in shards.values() if expected is not None and column in s.group_values):
            seg, stored = shard.segments, shard.group_values[column]
            inside = np.flatnonzero(seg.rows < len(expected))  # a row past the source is a problem of its own
            for i in inside[stored[inside] != expected[seg.rows[inside]]]:
                yield Problem(file=shard.name, row=int(seg.pack[i]), column=column,
                              message=f"document {seg.number[i]} (corpus document {seg.rows[i]}) holds {stored[i]}, "
                              f"but the source gives {expected[seg.rows[i]]}.")


def _batch_problems(
    corpus: Corpus,
    batch: DocumentBatch,
    expected: DocumentPieces,
    row0: int,
    packs: _Packs,
    tokens: _Tokens | None,
) -> Iterator[Problem]:
    """Compare one batch of corpus documents (global rows row0, row0+1, …) with the packs, where they
    must be the `expected` segments; their tokens too, read from `tokens`, unless None."""
    seg, manifest, complete = packs.segments, packs.manifest, packs.complete
    o = manifest.options
    m = len(batch.offsets) - 1
    lengths = np.diff(batch.offsets)
    e_rows, e_pieces, e_starts, e_lengths, _ = expected
    lo, hi = np.searchsorted(seg.rows, [row0, row0 + m], "left")
    a_rows, a_pieces = seg.rows[lo:hi] - row0, seg.pieces[lo:hi]
    width = int(max(e_pieces.max(initial=0), a_pieces.max(initial=0))) + 1
    e_keys, a_keys = e_rows * width + e_pieces, a_rows * width + a_pieces  # both sorted
    source_file = corpus.name(batch.file)

    def at_source(row: int) -> dict:
        return {"source_file": source_file, "source_row": batch.first_row + int(row)}

    found = np.isin(e_keys, a_keys)
    for i in np.flatnonzero(~found & complete):  # with shards missing, it may be in one of those
        r = int(e_rows[i])
        what = (
            f"piece {e_pieces[i]} ({e_lengths[i]} tokens)"
            if lengths[r] > o.max_len and o.overflow != "truncate"
            else f"the document ({lengths[r]} tokens)"
        )
        yield Problem(
            **at_source(r), column=o.column, message=f"{what} is in no pack (corpus row {row0 + r})."
        )
    for i in np.flatnonzero(~np.isin(a_keys, e_keys)) + lo:
        r = int(seg.rows[i] - row0)
        yield Problem(
            **packs.where(i),
            column="source_rows",
            message=f"document {seg.number[i]} is corpus row {seg.rows[i]} piece {seg.pieces[i]}, which the "
            f"source ({source_file} row {batch.first_row + r}: {lengths[r]} tokens) does not give with "
            f"max_len {o.max_len} and overflow {o.overflow!r}.",
        )
    matched = np.flatnonzero(found)
    actual = lo + np.searchsorted(a_keys, e_keys[matched])
    same_length = seg.lengths[actual] == e_lengths[matched]
    for e, a in zip(matched[~same_length], actual[~same_length]):
        yield Problem(
            **packs.where(a),
            column="cu_seqlens",
            message=f"document {seg.number[a]} (corpus row {seg.rows[a]}, piece {seg.pieces[a]}) has "
            f"{seg.lengths[a]} tokens; the source gives {e_lengths[e]}.",
        )
    if tokens is None:
        return
    readable = same_length & seg.readable[actual]
    e_sel, a_sel = matched[readable], actual[readable]
    columns = [("input_ids", batch.ids, {holder: ids for holder, (ids, _) in tokens.items()})]
    if batch.labels is not None and manifest.has_labels:
        columns.append(("labels", batch.labels, {holder: labels for holder, (_, labels) in tokens.items()}))
    # Compare in chunks of about _COMPARE_TOKENS tokens: the index arrays cost 8 bytes per token.
    chunk_of = np.cumsum(e_lengths[e_sel]) // _COMPARE_TOKENS
    bounds = np.flatnonzero(np.diff(chunk_of, prepend=-1, append=chunk_of[-1] + 1 if len(chunk_of) else 0))
    for first, end in zip(bounds[:-1], bounds[1:]):
        part = slice(first, end)
        for column, source_values, packed_values in columns:
            yield from _token_problems(
                column, source_values, packed_values, e_starts[e_sel[part]], packs, a_sel[part]
            )


def _token_problems(
    column: str,
    source_values: np.ndarray,
    packed_values: dict[int, np.ndarray],
    source_starts: np.ndarray,
    packs: _Packs,
    actual: np.ndarray,
) -> Iterator[Problem]:
    """Compare the tokens (or labels) of matched segments (`actual`, indices into the packs' segments),
    same lengths already checked; the packed ones are `packed_values[holder]`, for each segment's holder."""
    seg = packs.segments
    seg_lengths = seg.lengths[actual]
    expected = source_values[_ranges(source_starts, seg_lengths)]
    packed = np.empty_like(expected)
    out_starts = np.cumsum(seg_lengths) - seg_lengths
    for index in np.unique(seg.holder[actual]):
        mine = seg.holder[actual] == index
        values = packed_values[int(index)]
        packed[_ranges(out_starts[mine], seg_lengths[mine])] = values[
            _ranges(seg.starts[actual[mine]], seg_lengths[mine])
        ]
    bad = np.flatnonzero(expected != packed)
    if not len(bad):
        return
    which = np.searchsorted(out_starts, bad, "right") - 1
    which, first = np.unique(which, return_index=True)
    for k, token in zip(which, bad[first]):
        a = actual[k]
        within = int(token - out_starts[k])
        yield Problem(
            **packs.where(a),
            column=column,
            message=f"token {seg.offset[a] + within} of the pack (token {within} of document "
            f"{seg.number[a]}, corpus row {seg.rows[a]} piece {seg.pieces[a]}) is {packed[token]}; the "
            f"source has {expected[token]}.",
        )
