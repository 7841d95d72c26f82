"""Mixtures: one build from several corpora or document stores, each source a share of the output
tokens (or a number of epochs), selected in whole documents (or pieces of split ones), deterministically
with a seed.

A mixture file (YAML or JSON; `prepack build MIX.yaml`) reads:

    tokens: 50000000          # the output's token budget; or "all" (the default): every source's epochs
    seed: 0                   # seed of the document selection
    pack_within_source: false # true: no pack holds documents of two sources
    count: tokens             # or trained: the amounts count trained tokens (labels other than -100)
    sources:
      - {name: web, path: corpora/web/, weight: 0.6, max_epochs: 2}
      - {name: code, path: stores/code, weight: 0.3}
      - {name: math, path: s3://bucket/math/, epochs: 2}

`path` is a corpus or a document store, local (relative to the mixture file's directory) or a URI.
`prepack build` takes the same mixture as flags (`mixture_flags`), read into the same `MixtureSpec`:

    --source web=corpora/web/:0.6,max_epochs=2 --source code=stores/code:weight=0.3
    --source math=s3://bucket/math/:epochs=2 --tokens 50000000 --mix-seed 0 [--pack-within-source] [--mix-count trained]

`--source NAME=PATH[:AMOUNT]`, once per source in order (a relative PATH from the working directory):
AMOUNT is comma-separated `weight=W`, `epochs=E`, `max_epochs=N` (the file's keys), a bare number
being the weight; it is the text after PATH's last ':' unless that text holds a '/' (as a URI's
`//bucket` does), and each value is read as the YAML value the file would hold.

A weighted source takes `weight / (sum of weights)` of what the budget leaves after the sources given
in epochs; a source given in epochs takes that many times its tokens; without a budget every source is
given in epochs (1 when it says neither). `load_mixture` checks the file strictly: an unknown key, a
value of the wrong type or out of range, a key given twice (in JSON as in YAML), two sources of one
name, a weight without a budget, weights that overflow a float, each refused by file and field.

Selection (`select_source`): a source's packable tokens E (its documents' tokens as the overflow
policy leaves them) are repeated k = floor(T / E) times whole, and the rest of its request T is a
seeded random subset of its documents: the shortest prefix of a seeded permutation whose tokens come
nearest to the rest. So realized tokens are within one document of T (the permutation's boundary
document), and a source asked for less than E is downsampled by that subset alone. Where documents are
split anyway (`--overflow split`), the boundary document is cut after the piece that comes nearest, so
within one piece (max_len tokens); with other overflow policies documents stay whole. With `count:
trained` every amount counts trained tokens (`PieceCounts`: labels other than -100, a segment's first
token never) in place of tokens, and so does the selection, by documents or by pieces alike. A source asked
for more than `max_epochs` (and `MAX_COPIES`) copies of a document is refused, and so is a selection
whose plan needs more than the machine's memory (`check_memory`), before either is allocated.

Copies of a document are planned apart (`mixture_parts`): the documents are cut into R parts (R the
most copies of any document), each packed on its own, and the copies of one document go into
different parts (copy c into part c + a seeded offset, mod R), so no pack ever holds two copies of one
document, and each copy is packed among a different draw of the other sources' documents. With
`pack_within_source` each part is also packed per source.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from prepack.errors import InputError
from prepack.formats.common import field_path
from prepack.formats.shards import IGNORE_INDEX

__all__ = [
    "MAX_COPIES",
    "MIXTURE_SUFFIXES",
    "Mixture",
    "MixtureSource",
    "MixtureSpec",
    "PieceCounts",
    "SourceSelection",
    "check_memory",
    "is_mixture_file",
    "load_mixture",
    "mixture_flags",
    "mixture_parts",
    "packable_tokens",
    "piece_counts",
    "read_mixture",
    "requested_tokens",
    "segment_trained_tokens",
    "select_source",
    "selection_pieces",
    "split_pieces",
    "trained_segments",
]

MIXTURE_SUFFIXES = (".yaml", ".yml", ".json")
# A source's name is a part of its input files' names in the manifest (`NAME/file.parquet`).
SOURCE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
# Source ids are stored as uint16 (`prepack.formats.mixture.SOURCE_ID_TYPE`).
MAX_SOURCES = 2**16 - 1
# The most copies of a document a mixture takes. Each round of copies is planned on its own
# (`mixture_parts`), so rounds cost time beyond their documents': without a cap, `epochs: 100000` of a
# small source plans 100,000 parts.
MAX_COPIES = 10_000
# What planning holds per packed document, at least: its row in its part (4 bytes, `mixture_parts`), its
# length there (2, `compact_lengths`), its pack slot (4) and the planner's working copy (4)
# (`prepack.building.plan`'s docstring). A request needing more than the machine's memory is refused.
PLAN_BYTES_PER_DOCUMENT = 14


class _Spec(BaseModel):
    # strict: YAML gives typed values, and "2" is not a weight; frozen, unknown keys refused.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


_Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class MixtureSource(_Spec):
    """One source of a mixture."""

    name: str = Field(pattern=SOURCE_NAME, description="Unique; names the source in the manifest and reports.")
    path: str = Field(min_length=1, description="A corpus or a document store: a path (relative to the mixture file) or a URI.")
    weight: _Positive | None = Field(default=None, description="Share of the output tokens (normalized over the weighted sources).")
    epochs: Annotated[_Positive, Field(le=MAX_COPIES)] | None = Field(
        default=None, description="Instead of a weight: this many times the source's tokens."
    )
    # The manifest's bound (`prepack.formats.mixture.SourceCounts`): a larger cap is none.
    max_epochs: int | None = Field(default=None, ge=1, le=2**31 - 1, description="With a weight: the most copies of any document.")

    @model_validator(mode="after")
    def _one_amount(self) -> MixtureSource:
        if self.weight is not None and self.epochs is not None:
            raise ValueError("give a weight or epochs, not both")
        if self.max_epochs is not None and self.weight is None:
            raise ValueError("max_epochs caps a weight's repetition: give it with a weight")
        return self


class MixtureSpec(_Spec):
    """A mixture file, checked."""

    sources: list[MixtureSource] = Field(min_length=1, max_length=MAX_SOURCES)
    tokens: Annotated[int, Field(ge=1, le=2**63 - 1)] | Literal["all"] = Field(
        default="all", description="The output's token budget, or 'all': every source its epochs (default 1)."
    )
    seed: int = Field(default=0, ge=0, le=2**63 - 1, description="Seed of the document selection.")
    pack_within_source: bool = Field(default=False, description="No pack holds documents of two sources.")
    count: Literal["tokens", "trained"] = Field(
        default="tokens",
        description="What the budget, weights and epochs count: every packed token, or the trained ones (labels other than -100).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> MixtureSpec:
        names = [source.name for source in self.sources]
        if len(set(names)) != len(names):
            twice = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(f"source names must be unique; {', '.join(map(repr, twice))} appear twice or more")
        if self.tokens == "all" and any(source.weight is not None for source in self.sources):
            raise ValueError("a weight is a share of a token budget: give 'tokens' (--tokens), or epochs instead of weights")
        weighted = [source for source in self.sources if source.weight is not None]
        # `requested_tokens` shares the budget as budget x weight / (sum of weights), in floats: both must be finite.
        for source in weighted:
            if not math.isfinite(self.tokens * source.weight):
                raise ValueError(
                    f"source {source.name!r}: weight {source.weight:g} times the budget of {self.tokens:,} tokens is past the "
                    "largest float: weights are shares, give them smaller, in proportion"
                )
        try:
            math.fsum(source.weight for source in weighted)
        except OverflowError:
            raise ValueError(
                f"the weights of sources {', '.join(repr(source.name) for source in weighted)} sum past the largest float: "
                "weights are shares, give them smaller, in proportion"
            ) from None
        return self


def is_mixture_file(spec: str | os.PathLike) -> bool:
    """Whether `spec` names a mixture file (by its suffix: no corpus file has these)."""
    return str(spec).lower().endswith(MIXTURE_SUFFIXES) and not Path(spec).is_dir()


@dataclass(frozen=True)
class Mixture:
    """A checked mixture and where it was given: `origin` names it in messages (the file, or the
    flags), and a source's relative path lies under `base`."""

    spec: MixtureSpec
    origin: str
    base: str

    def __str__(self) -> str:
        return self.origin


def _problems(exc: ValidationError, where) -> str:
    """The first problems of a pydantic error, each named by `where(location)`."""
    return "; ".join(f"{where(e['loc'])}: {e['msg']}" for e in exc.errors(include_url=False)[:5])


def load_mixture(path: str | os.PathLike) -> MixtureSpec:
    """Read and check the mixture file at `path` (YAML, or JSON for `.json`). Raises InputError naming
    the file and the field of the first problems."""
    import yaml  # only for mixtures

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read the mixture file ({exc}).") from None
    try:
        if str(path).lower().endswith(".json"):
            data = json.loads(text, object_pairs_hook=_unique_keys)
        else:
            data = yaml.load(text, Loader=_unique_key_loader())
    except (ValueError, yaml.YAMLError) as exc:
        raise InputError(f"{path}: not a valid mixture file ({str(exc).splitlines()[0]}).") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: a mixture file holds a mapping with 'sources', not {type(data).__name__}.")
    try:
        return MixtureSpec.model_validate(data)
    except ValidationError as exc:
        raise InputError(f"{path}: invalid mixture: {_problems(exc, field_path)}.") from None


def read_mixture(path: str | os.PathLike) -> Mixture:
    """The mixture file at `path`, checked (`load_mixture`); its sources' relative paths lie beside it."""
    return Mixture(load_mixture(path), str(path), os.path.dirname(os.path.abspath(path)))


# The file's top-level keys as `prepack build` spells them.
_FLAGS = {
    "sources": "--source",
    "tokens": "--tokens",
    "seed": "--mix-seed",
    "pack_within_source": "--pack-within-source",
    "count": "--mix-count",
}
SOURCE_SYNTAX = "NAME=PATH[:AMOUNT]"


def mixture_flags(
    corpus: str | None, sources: list[str], tokens: str | None, seed: str | None, pack_within_source: bool, count: str | None = None
) -> Mixture | None:
    """The mixture that `prepack build`'s flags give (module docstring), checked by `MixtureSpec` as
    a file is; None for a build of `corpus` (a corpus, store or mixture file) without them. Raises
    InputError naming the flag: a bad value, or mixture flags beside a corpus or a mixture file."""
    values = {"sources": sources, "tokens": tokens, "seed": seed, "pack_within_source": pack_within_source or None, "count": count}
    given = ", ".join(_FLAGS[key] for key, value in values.items() if value)
    if corpus is not None and given:
        if is_mixture_file(corpus):
            raise InputError(f"{corpus} is a mixture file, and the mixture flags ({given}) give one too: give it in the file or as flags, not both.")
        raise InputError(
            f"{corpus} is a corpus, and the mixture flags ({given}) build a mixture of --source flags: give it as "
            f"--source {SOURCE_SYNTAX}, or leave out {given}."
        )
    if corpus is not None:
        return None
    if not sources:
        raise InputError(
            f"{f'the mixture flags ({given}) need' if given else 'prepack build needs'} a CORPUS (or a mixture file), "
            f"or a mixture's sources, each as --source {SOURCE_SYNTAX}."
        )
    data = {key: _scalar(value) if isinstance(value, str) else value for key, value in values.items() if key != "sources" and value is not None}
    data["sources"] = [_source_flag(flag) for flag in sources]

    def where(location: tuple) -> str:
        if location and location[0] == "sources" and len(location) > 1 and isinstance(location[1], int):
            field = field_path(location[2:])
            return f"--source {sources[location[1]]!r}" + (f": {field}" if field != "(top level)" else "")
        return _FLAGS.get(location[0], "--source") if location else "--source"

    try:
        spec = MixtureSpec.model_validate(data)
    except ValidationError as exc:
        raise InputError(f"invalid mixture flags: {_problems(exc, where)}.") from None
    return Mixture(spec, "--source", os.getcwd())


def _source_flag(flag: str) -> dict:
    """One `--source NAME=PATH[:AMOUNT]` as the mapping a mixture file gives a source."""
    name, equals, path = flag.partition("=")
    if not equals:
        raise InputError(f"--source {flag!r}: give {SOURCE_SYNTAX}, e.g. web=corpora/web/:0.6.")
    source = {"name": name, "path": path}
    head, colon, amount = path.rpartition(":")
    if not colon or "/" in amount:  # no amount: the file's default (1 epoch)
        return source
    source["path"] = head
    for item in amount.split(","):
        key, equals, value = item.partition("=") if "=" in item else ("weight", "=", item)
        if not value:
            raise InputError(f"--source {flag!r}: an empty amount in {amount!r}; give weight=W, epochs=E or max_epochs=N, comma-separated.")
        if key in source:
            raise InputError(f"--source {flag!r}: {key!r} is given twice.")
        source[key] = _scalar(value)
    return source


def _scalar(text: str):
    """A flag's value as the YAML value a mixture file would hold (`2` an int, `0.5` a float, `all` a string)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's keys and values, refusing a key given twice (json keeps the last one silently), as
    `_unique_key_loader` does for YAML."""
    data = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"key {key!r} appears twice")
        data[key] = value
    return data


def _unique_key_loader() -> type:
    """PyYAML's safe loader refusing duplicate keys (made on use: importing this module imports no yaml)."""
    import yaml

    class Loader(yaml.SafeLoader):
        """PyYAML's safe loader, refusing a key given twice (PyYAML keeps the last one silently)."""

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return Loader


def source_location(mixture: Mixture, source: MixtureSource) -> str:
    """Where `source` lies: a URI as given, a relative path under the mixture's `base`."""
    from prepack.storage.remote import is_uri

    if is_uri(source.path) or os.path.isabs(source.path):
        return source.path
    return os.path.join(mixture.base, source.path)


def packable_tokens(
    lengths: np.ndarray, untrained: np.ndarray, max_len: int, overflow: str, drop_untrained: bool
) -> np.ndarray:
    """The tokens each document puts into packs (in the dtype of `lengths`, a copy): its length, cut to
    max_len with "truncate", 0 when "drop" leaves it out, 0 when it is untrained and `drop_untrained`.
    A document with none is never selected."""
    tokens = np.array(lengths)
    max_len = min(max_len, np.iinfo(tokens.dtype).max)
    if overflow == "truncate":
        np.minimum(tokens, max_len, out=tokens)
    elif overflow == "drop":
        tokens[tokens > max_len] = 0
    if drop_untrained:
        tokens[np.asarray(untrained, dtype=bool)] = 0
    return tokens


def split_pieces(tokens: np.ndarray, max_len: int) -> Callable[[int], np.ndarray]:
    """`select_source`'s `pieces` for documents of `tokens` packable tokens split into max_len pieces:
    a document's pieces' tokens, all max_len but a shorter last one."""

    def pieces(row: int) -> np.ndarray:
        length = int(tokens[row])
        return np.minimum(length - np.arange(0, length, max_len, dtype=np.int64), max_len)

    return pieces


def selection_pieces(
    tokens: np.ndarray, max_len: int, overflow: str, trained: PieceCounts | None
) -> Callable[[int], np.ndarray] | None:
    """`select_source`'s `pieces` for a source (`tokens`: its documents' packable tokens): None where the
    overflow policy keeps documents whole; where it splits them (split, error), each max_len piece's
    tokens (`split_pieces`), or its trained tokens (`trained`, a mixture counting them)."""
    if overflow not in ("split", "error"):
        return None
    return split_pieces(tokens, max_len) if trained is None else trained.of


@dataclass(frozen=True)
class PieceCounts:
    """A source's trained tokens as packed (a mixture counting trained tokens): every segment its
    documents become under the overflow policy (`prepack.building.plan.document_pieces`), in (row,
    piece) order, and its trained tokens: labels other than -100, each segment's first token never
    (the collator masks it), every other token of a source without labels."""

    offsets: np.ndarray  # int64 [documents + 1]: each document's first segment
    trained: np.ndarray  # int32 [segments]

    def of(self, row: int) -> np.ndarray:
        """The trained tokens of each segment of document `row` (`select_source`'s `pieces`)."""
        return self.trained[self.offsets[row] : self.offsets[row + 1]]

    def documents(self, packable: np.ndarray) -> np.ndarray:
        """Every document's trained tokens (int64), 0 where it has no packable token (`packable_tokens`)."""
        running = np.concatenate(([0], np.cumsum(self.trained, dtype=np.int64)))
        per_document = running[self.offsets[1:]] - running[self.offsets[:-1]]
        per_document[packable == 0] = 0
        return per_document


def piece_counts(batches: list[tuple[np.ndarray, np.ndarray]]) -> PieceCounts:
    """A source's `PieceCounts` from its batches' `trained_segments`, in row order."""
    per_document = np.concatenate([segments for segments, _ in batches]) if batches else np.zeros(0, np.int64)
    trained = np.concatenate([values for _, values in batches]) if batches else np.zeros(0, np.int32)
    return PieceCounts(np.concatenate(([0], np.cumsum(per_document, dtype=np.int64))), trained)


def trained_segments(offsets: np.ndarray, labels: np.ndarray | None, max_len: int, overflow: str) -> tuple[np.ndarray, np.ndarray]:
    """(segments per document, trained tokens per segment: int32) of the documents `labels[offsets[i]:offsets[i+1]]`
    (None: no labels) as `PieceCounts` counts them."""
    from prepack.building.plan import document_pieces  # numba's kernels: for the builds that count trained tokens

    offsets = np.asarray(offsets, dtype=np.int64)
    segments = document_pieces(np.diff(offsets), max_len, overflow)
    per_document = np.bincount(segments.rows, minlength=len(offsets) - 1)
    documents = None if labels is None else np.asarray(labels)[offsets[0] : offsets[-1]]
    return per_document, segment_trained_tokens(documents, segments.starts, segments.lengths)


def segment_trained_tokens(labels: np.ndarray | None, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The trained tokens (int32) of the segments `labels[starts[i] : starts[i] + lengths[i]]` as `PieceCounts`
    counts them: labels other than -100, a segment's first token never; without labels (None), every token
    but the first. `verify` counts a full build's packs so."""
    if labels is None:
        return np.maximum(lengths - 1, 0).astype(np.int32)
    running = np.concatenate(([0], np.cumsum(np.asarray(labels) != IGNORE_INDEX, dtype=np.int64)))
    past_first = starts + np.minimum(lengths, 1)
    return (running[starts + lengths] - running[past_first]).astype(np.int32)


def requested_tokens(spec: MixtureSpec, available: list[int]) -> list[int]:
    """What each source is asked for, in tokens, given each one's packable tokens `available`.
    Raises InputError when the sources in epochs leave nothing of the budget for the weighted ones."""
    fixed = [
        round((source.epochs or 1.0) * tokens) if source.weight is None else 0
        for source, tokens in zip(spec.sources, available)
    ]
    weights = [source.weight or 0.0 for source in spec.sources]
    if spec.tokens == "all" or not any(weights):
        return fixed
    left = spec.tokens - sum(fixed)
    if left <= 0:
        raise InputError(
            f"the sources given in epochs take {sum(fixed):,} tokens, the whole budget of {spec.tokens:,}: "
            "nothing is left for the weighted sources."
        )
    total = math.fsum(weights)
    return [round(left * weight / total) if weight else amount for weight, amount in zip(weights, fixed)]


@dataclass(frozen=True)
class SourceSelection:
    """The documents a source puts into the mixture: every row of `eligible` (its documents with
    packable tokens, ascending) `epochs` times, then the rows of `partial` (a seeded subset,
    ascending) once more; of that last copy, row `cut_row` only its first `cut_pieces` pieces (0:
    whole), where selection is by pieces (`select_source`)."""

    eligible: np.ndarray  # rows within the source (uint32 while they fit)
    epochs: int
    partial: np.ndarray  # rows within the source, as `eligible`
    requested: int  # tokens asked for
    realized: int  # tokens selected
    available: int  # packable tokens of the eligible documents: one epoch
    cut_row: int = -1
    cut_pieces: int = 0

    @property
    def documents(self) -> int:
        return self.epochs * len(self.eligible) + len(self.partial)


def _rows(rows: np.ndarray, count: int) -> np.ndarray:
    """Row numbers below `count` in 4 bytes while they fit (8 above)."""
    return rows.astype(np.uint32 if count <= 2**32 else np.int64, copy=False)


def _rng(seed: int, name: str) -> np.random.Generator:
    """A source's own generator: its selection does not change when other sources are added or reordered."""
    return np.random.default_rng([seed, *name.encode()])


def _nearest(running: np.ndarray, target: int) -> int:
    """The index of `running` (non-decreasing, from 0) nearest to `target`, the lower one on a tie."""
    above = int(np.searchsorted(running, target, "left"))  # the first with at least `target`
    if above == len(running):
        return above - 1
    return above if above == 0 or running[above] - target < target - running[above - 1] else above - 1


def select_source(
    name: str,
    tokens: np.ndarray,
    requested: int,
    seed: int,
    max_epochs: int | None = None,
    pieces: Callable[[int], np.ndarray] | None = None,
) -> SourceSelection:
    """Select whole documents of one source (`tokens`: each document's packable tokens) worth
    `requested` tokens: whole epochs, then the prefix of a seeded permutation of the eligible
    documents whose tokens come nearest to what is left (the shorter prefix on a tie). The realized
    tokens differ from `requested` by at most the tokens of one document.

    With `pieces` (documents split into max_len pieces: `pieces(row)` the tokens of each piece of
    document `row`, summing to `tokens[row]`), the prefix is cut inside the document at its boundary,
    after the piece that comes nearest: the realized tokens are then within one piece of `requested`.
    (`tokens` and the pieces may count anything additive: trained tokens, say.)

    Raises InputError when that takes more copies of a document than `max_epochs` or `MAX_COPIES`
    allow: before anything is allocated when the whole epochs alone do."""
    tokens = np.asarray(tokens)
    available = int(tokens.sum(dtype=np.int64))
    if available == 0:
        raise InputError(f"source {name!r}: no document has a token to pack.")
    epochs, rest = divmod(int(requested), available)
    limit = MAX_COPIES if max_epochs is None else min(max_epochs, MAX_COPIES)
    if epochs > limit:
        raise InputError(_copies_refused(name, requested, available, epochs, max_epochs, exact=False))
    eligible = _rows(np.flatnonzero(tokens > 0), len(tokens))
    order = _rng(seed, name).permutation(eligible)
    running = np.concatenate(([0], np.cumsum(tokens[order], dtype=np.int64)))
    cut_row, cut_pieces = -1, 0
    if pieces is None:
        take = _nearest(running, rest)
        selected = int(running[take])
    else:
        take = int(np.searchsorted(running, rest, "left"))  # the boundary document is order[take - 1]
        selected = int(running[take])
        if take > 0:
            boundary = int(order[take - 1])
            within = np.concatenate(([0], np.cumsum(pieces(boundary), dtype=np.int64)))
            kept = _nearest(within, rest - int(running[take - 1]))
            selected = int(running[take - 1]) + int(within[kept])
            if kept == 0:
                take -= 1
            elif kept < len(within) - 1:
                cut_row, cut_pieces = boundary, kept
    copies = epochs + (take > 0)
    if copies > limit:
        raise InputError(_copies_refused(name, requested, available, copies, max_epochs, exact=True))
    realized = epochs * available + selected
    return SourceSelection(eligible, epochs, np.sort(order[:take]), int(requested), realized, available, cut_row, cut_pieces)


def _copies_refused(name: str, requested: int, available: int, copies: int, max_epochs: int | None, *, exact: bool) -> str:
    """Why a source's request is refused: the copies of some documents it needs (at least, unless
    `exact`), against its limit."""
    if max_epochs is not None and max_epochs <= MAX_COPIES:
        limit = f"its max_epochs is {max_epochs}"
    else:
        limit = f"a mixture takes at most {MAX_COPIES:,} copies of a document (MAX_COPIES)"
    return (
        f"source {name!r}: asked for {requested:,} tokens, {requested / available:.3g} times its {available:,} packable "
        f"tokens, which needs {'' if exact else 'at least '}{copies:,} copies of some documents; {limit}."
    )


def _physical_memory() -> int | None:
    """The machine's memory in bytes, or None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_memory(spec: MixtureSpec, selections: list[SourceSelection], memory: int | None = None) -> None:
    """Refuse selections whose documents need more memory to plan (`PLAN_BYTES_PER_DOCUMENT` each, at
    least) than `memory` bytes (None: the machine's, `_physical_memory`), before the plan allocates them,
    naming the source selecting the most with its request."""
    memory = _physical_memory() if memory is None else memory
    documents = sum(s.documents for s in selections)
    if memory is None or documents * PLAN_BYTES_PER_DOCUMENT <= memory:
        return
    most = max(range(len(selections)), key=lambda i: selections[i].documents)
    name, selected = spec.sources[most].name, selections[most]
    raise InputError(
        f"the mixture selects {documents:,} documents, which need at least {documents * PLAN_BYTES_PER_DOCUMENT:,} bytes "
        f"of memory to plan ({PLAN_BYTES_PER_DOCUMENT} a document), and this machine has {memory:,} bytes of memory; "
        f"source {name!r} selects {selected.documents:,} of them: asked for {selected.requested:,} tokens, "
        f"{selected.requested / selected.available:.3g} times its {selected.available:,} packable tokens. Ask for fewer tokens."
    )


def mixture_parts(
    selections: list[SourceSelection], first_rows: np.ndarray, rows: int, within_source: bool, seed: int
) -> tuple[list[np.ndarray], list[dict[int, int]]]:
    """The mixture's documents, as the global rows (source's first row + its row; `rows` in all) of each part that
    is packed on its own: R parts, R the most copies any document has, copy c of a document going into
    part (c + its seeded offset) mod R, so no part holds two copies of one document and each copy has
    other company; with `within_source`, each part per source too. Each part's rows are in a seeded
    order (the planner's order among equal lengths). Beside each part, the documents of it that are
    cut (a selection's `cut_row`, in its last copy): global row → pieces kept."""
    rounds = max(s.epochs + (len(s.partial) > 0) for s in selections)
    rng = np.random.default_rng([seed, rounds])
    grouped: list[list[np.ndarray]] = [[] for _ in range(rounds * (len(selections) if within_source else 1))]
    cut: list[dict[int, int]] = [{} for _ in grouped]
    for number, (s, first) in enumerate(zip(selections, first_rows)):
        offset = rng.integers(rounds, size=len(s.eligible), dtype=np.uint16 if rounds < 2**15 else np.int64)
        extra = np.isin(s.eligible, s.partial, assume_unique=True)  # the documents taken once more
        for copy in range(s.epochs + (len(s.partial) > 0)):
            taken = slice(None) if copy < s.epochs else extra
            part = (offset[taken] + copy) % rounds
            copies = _rows(s.eligible[taken], rows) + _rows(np.asarray(first), rows)
            for index in np.unique(part):
                grouped[index * (len(selections) if within_source else 1) + (number if within_source else 0)].append(copies[part == index])
        if s.cut_pieces:
            index = (int(offset[np.searchsorted(s.eligible, s.cut_row)]) + s.epochs) % rounds
            cut[index * (len(selections) if within_source else 1) + (number if within_source else 0)][int(first) + s.cut_row] = s.cut_pieces
    parts, cuts = [], []
    for number, pieces in enumerate(grouped):
        if pieces:
            parts.append(np.random.default_rng([seed, rounds, number]).permutation(np.concatenate(pieces)))
            cuts.append(cut[number])
    return parts, cuts
