"""`inspect`: what a build holds and what packing saved, from the manifest and the per-pack columns.

Only `cu_seqlens`, `max_seqlen`, `source_rows` and `source_pieces` are read, from memory-mapped
shards: the pages of `input_ids`, `segment_ids` and `labels` (nearly all of a shard's bytes) are never
touched, so a report on a billion-token build costs about as much as one on its document count. A
preference-pair build is the exception: its prompt and completion tokens are counted from its `labels`
(and its prompts checked in `input_ids`: `prepack.check.pairs`), so the split it prints is the shards',
never the manifest's alone.

    report = inspect_build("packed/", batch_size=8, seed=0)
    report.fill, report.cost.pad_to_max_len.ratio
    rich.print(render(report))            # what `prepack inspect` prints
    plot(report, "report.png")            # needs matplotlib (`pip install 'prepack-llm[plot]'`)

"Documents" in the distributions are the segments the shards hold, i.e. corpus documents after
`--overflow` split, truncated or dropped them; the manifest's counts say how many were.
"""

from __future__ import annotations

import json
import math
import operator
import os
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import numpy as np
from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from prepack.building.plan import assign_packs, checked_cap
from prepack.building.balance import DEFAULT_TOKEN_COST, epoch_imbalance, pack_costs, validated_token_cost
from prepack.storage.cache import ShardCache, build_cache
from prepack.errors import FormatError, InputError, PrepackError, optional_imports
from prepack.formats.common import StrictModel, list_column
from prepack.check.pairs import PairCounts, pair_count_problems, shard_pairs
from prepack.formats.shards import DESIRABLE, Manifest, check_layout, check_shard, read_manifest, shard_path, unit_name
from prepack.storage.output import output_errors
from prepack.storage.remote import is_uri
from prepack.sources.store import open_build_store

__all__ = [
    "Cost",
    "Costs",
    "PairReport",
    "Distribution",
    "InspectReport",
    "ShardSummary",
    "SourceSummary",
    "StepBalance",
    "inspect_build",
    "plot",
    "render",
]

_BINS = 32  # histogram bins: enough shape for one terminal line or one plot panel
_FILL_BINS = 20  # pack fill in steps of 5%
COST_NOTE = (
    "compute = token positions a fixed-length batch pays for. packed: packs x max_len. pad to max_len: "
    "documents x max_len. pad to longest: documents in corpus order, shuffled with --seed, cut into "
    "batches of --batch-size (last one partial), each costing its size x its longest document. "
    "Documents are the segments in the packs, as one longer than max_len cannot be padded to it. "
    "Attention's quadratic term is not counted (with per-document attention it favours packing more)."
)


class Distribution(StrictModel):
    """Summary and histogram of one per-pack or per-document quantity.

    Percentiles are nearest-rank: the smallest value with at least p% of the values at or below it, so
    they are always values that occur. Bin i counts values in [edges[i], edges[i+1]), the last bin also
    its right edge.
    """

    count: int
    min: float
    mean: float
    p50: float
    p90: float
    p99: float
    max: float
    edges: list[float]
    counts: list[int]


class Cost(StrictModel):
    """Token positions of compute for one way of batching the corpus."""

    tokens: int
    padding_tokens: int  # tokens - the real tokens
    ratio: float  # tokens / the packed cost


class Costs(StrictModel):
    packed: Cost
    pad_to_max_len: Cost
    pad_to_longest_in_batch: Cost


class StepBalance(StrictModel):
    """How unequal the ranks' work is in the steps `PackedSampler` deals (epoch 0, --seed), without and
    with `balance="attention"`; cost model and figures from `prepack.building.balance`."""

    world_size: int
    batch_size: int
    token_cost: float
    unbalanced_max_over_mean: float  # mean over steps of slowest rank / mean rank
    balanced_max_over_mean: float
    unbalanced_waiting_share: float  # share of step time lost waiting for the slowest rank
    balanced_waiting_share: float


class CapCost(StrictModel):
    """What `prepack build --max-docs-per-pack K` makes of the build's documents: planned again from the packs'
    segment lengths with the build's algorithm (a plan depends on nothing else; a pair is one unit of two)."""

    max_docs_per_pack: int
    packs: int
    fill: float  # tokens / (packs * max_len)
    more_packs_percent: float  # 100 * (packs - the build's packs) / the build's packs


# The caps `inspect` prices by default: those below the build's fullest pack.
DEFAULT_CAPS = (2, 4, 8, 16, 32, 64, 128)


class PairReport(StrictModel):
    """A preference-pair build's pairs (`Manifest.pairs`), and what TRL's DPOTrainer would pad them to."""

    pairs: int  # in the packs
    read: int  # in the corpus
    truncated: int  # pairs whose completions were cut
    dropped: int
    prompt_tokens: int  # in the packs: each pair's prompt twice, once per document
    completion_tokens: int
    shared_prompt_saves: int  # prompt tokens a layout storing each prompt once would not compute: half of them
    #                           (of a group build's: G - 1 of every G)
    trl_padded: Cost  # TRL's DataCollatorForPreference: random batches of `batch_size` pairs, chosen and
    #                   rejected together padded to the batch's longest document (a group build: its G documents)
    group_size: int | None = None  # a group build's G; None for pairs
    scores_column: str | None = None  # a group build's column of scores, stored per completion (group_scores)
    ranks_column: str | None = None  # a group build's column of ranks, stored per completion (group_ranks)
    # An unpaired (KTO) build's examples in the packs (each a pair of completion and KL completion: `pairs`) labelled
    # desirable and undesirable, counted from the shards' `desirable`; None for other builds.
    desirable: int | None = None
    undesirable: int | None = None


class ShardSummary(StrictModel):
    name: str
    packs: int
    documents: int
    tokens: int
    bytes: int
    fill: float


class SourceSummary(StrictModel):
    """One source of a mixture build: its request (from the manifest) and what the packs hold of it
    (counted from their `source_ids`, and equal to the manifest's counts, or `inspect` refuses)."""

    name: str
    requested_tokens: int
    requested_weight: float
    full_epochs: int
    partial_documents: int
    documents: int  # in the packs (first pieces)
    segments: int
    tokens: int
    weight: float  # tokens / the build's tokens
    trained_tokens: int | None = None  # a mixture counting trained tokens (`mixture.count`): the manifest's, as requested_tokens counts


# Percentage points of fill a rebuild must gain over a build grown by appends for `inspect` to advise one.
# A point of fill is a point of training compute spent on padding, which on any run worth resuming costs
# more than a build pass; below it, a rebuild's cost (a new pack order, which a resumed run cannot follow
# mid-epoch) outweighs the gain. Appends of 10 % lose far less (`benchmarks/bench_append.py`).
REBUILD_GAIN_PP = 1.0


class AppendReport(StrictModel):
    """A build grown by appends (`Manifest.generations`): its fill against a build of the same documents at once."""

    appends: int
    rebuild_packs: int  # the packs a build of the same documents at once takes
    rebuild_fill: float  # tokens / (rebuild_packs * max_len)
    gap_pp: float  # 100 * (rebuild_fill - fill): what a rebuild gains, in percentage points
    rebuild_advised: bool  # gap_pp > REBUILD_GAIN_PP


class InspectReport(StrictModel):
    """Everything `prepack inspect` shows; `to_json()` is what `--json` prints."""

    path: str
    max_len: int
    overflow: str
    has_labels: bool
    documents: int  # corpus rows read
    input_tokens: int  # tokens read from the corpus
    segments: int  # documents and document pieces in the packs
    tokens: int  # tokens in the packs
    packs: int
    shards: int
    fill: float  # tokens / (packs * max_len)
    padding_tokens: int  # packs * max_len - tokens
    lower_bound: int  # ceil(tokens / max_len)
    over_lower_bound: int  # packs - lower_bound
    over_lower_bound_percent: float  # 100 * over_lower_bound / lower_bound
    empty: int
    split: int
    split_pieces: int
    truncated: int
    truncated_tokens: int
    dropped: int
    dropped_tokens: int
    untrained: int  # documents with no trained token (see schemas/shard-format.md)
    untrained_tokens: int
    drop_untrained: bool  # whether they were left out of the packs
    documents_per_pack: Distribution
    document_length: Distribution  # segment lengths: np.diff of cu_seqlens
    pack_fill: Distribution
    batch_size: int
    seed: int
    cost: Costs
    steps: StepBalance | None  # only when a world size was given
    per_shard: list[ShardSummary]
    sources: list[SourceSummary] | None = None  # a mixture build's
    pairs: PairReport | None = None  # only for a preference-pair build
    caps: list[CapCost] | None = None  # None for a mixture, whose packs are planned per round of copies
    appends: AppendReport | None = None  # only for a build grown by appends

    def to_json(self) -> str:
        """What `prepack inspect --json` prints: strict JSON, never a NaN or Infinity token (which JSON
        parsers refuse); a non-finite figure raises PrepackError instead (the inputs are validated so
        that none arises)."""
        try:
            return json.dumps(self.model_dump(mode="json"), indent=2, allow_nan=False)
        except ValueError as exc:
            raise PrepackError(f"the report of {self.path} holds a number JSON cannot carry: {exc}.") from None


def _distribution(values: np.ndarray, edges: np.ndarray) -> Distribution:
    counts, _ = np.histogram(values, bins=edges)
    p50, p90, p99 = np.percentile(values, [50, 90, 99], method="inverted_cdf")
    return Distribution(
        count=len(values),
        min=float(values.min()),
        mean=float(values.mean()),
        p50=float(p50),
        p90=float(p90),
        p99=float(p99),
        max=float(values.max()),
        edges=[float(e) for e in edges],
        counts=[int(c) for c in counts],
    )


def _integer_edges(values: np.ndarray) -> np.ndarray:
    """At most _BINS bins of equal integer width covering [min, max]."""
    low, high = int(values.min()), int(values.max())
    width = -(-(high - low + 1) // _BINS)
    bins = -(-(high - low + 1) // width)
    return low + width * np.arange(bins + 1, dtype=np.float64)


def _shard_columns(batch, where: str, max_len: int) -> tuple[np.ndarray, ...]:
    """(tokens per pack, documents per pack, segment lengths, source rows, source pieces, source ids: a
    mixture's, else 0), read from the small columns only, checked by `check_layout` (`verify` checks the
    token columns too)."""
    layout = check_layout(batch, max_len, where)

    def flat(name: str) -> np.ndarray:
        offsets, values = list_column(batch, name, where)
        return values[offsets[0] : offsets[-1]]

    rows = flat("source_rows")
    sources = flat("source_ids") if "source_ids" in batch.schema.names else np.zeros(len(rows), np.uint16)
    return layout.tokens, layout.documents, layout.lengths, rows, flat("source_pieces"), sources


def _shard_pairs(batch, where: str, max_len: int, documents: np.ndarray, lengths: np.ndarray, size: int) -> PairCounts:
    """A pair build's shard counted from its tokens (`shard_pairs`; `documents` per pack, `lengths` per
    document), checked in full first (`check_shard`)."""
    if "labels" not in batch.schema.names:
        raise FormatError(f"{where}: a preference-pair build's shard has labels, its prompts' and completions'; run `prepack verify`.")
    check_shard(batch, max_len, where)
    ids_offsets, ids = list_column(batch, "input_ids", where)
    label_offsets, labels = list_column(batch, "labels", where)
    starts = np.cumsum(lengths) - lengths  # the documents back to back, as check_shard found them
    desirable = None
    if DESIRABLE in batch.schema.names:  # an unpaired build's labels (check_shard holds them to its pairs)
        offsets, values = list_column(batch, DESIRABLE, where)
        desirable = values[offsets[0] : offsets[-1]]
    found, problems = shard_pairs(ids[ids_offsets[0] :], labels[label_offsets[0] :], starts, lengths, max_len, size, desirable)
    for document, column, message in problems[:1]:
        row = int(np.searchsorted(np.cumsum(documents), document, "right"))
        raise FormatError(f"{where}, row {row}, column {column!r}: a document {message[:-1]}; run `prepack verify`.")
    return found


def _read_columns(
    build: Path | ShardCache, manifest: Manifest
) -> tuple[list[ShardSummary], dict[str, np.ndarray], PairCounts | None]:
    """The shards' summaries and columns, read from the directory `build` or, for a build in object
    storage, from the copies in the cache `build` (problems name the shards' URIs); a pair build's
    counts (`_shard_pairs`)."""
    max_len = manifest.options.max_len
    pairs = PairCounts(0, 0, 0, 0) if manifest.pairs is not None else None
    summaries, parts = [], {"tokens": [], "docs": [], "lengths": [], "rows": [], "pieces": [], "sources": []}
    for index, info in enumerate(manifest.shards):
        if isinstance(build, Path):
            file = shard_path(build, index, info)
            where = str(file)
        else:
            file, where = build.shard(info), build.name(info)
        batch = manifest.open_shard(file, where)
        if batch.num_rows != info.rows:
            raise FormatError(f"{where}: {batch.num_rows} packs, but the manifest says {info.rows}.")
        columns = _shard_columns(batch, where, max_len)
        for key, values in zip(parts, columns):
            parts[key].append(values)
        if pairs is not None and manifest.store is None:
            pairs = pairs.add(_shard_pairs(batch, where, max_len, columns[1], columns[2], manifest.options.pairs.size))
        tokens = int(columns[0].sum())
        summaries.append(
            ShardSummary(
                name=info.name,
                packs=info.rows,
                documents=len(columns[2]),
                tokens=tokens,
                bytes=info.bytes,
                fill=tokens / (info.rows * max_len) if info.rows else 0.0,
            )
        )
    dtypes = {"tokens": np.int64, "docs": np.int64, "lengths": np.int64, "rows": np.int64, "pieces": np.int32, "sources": np.uint16}
    flat = {k: np.concatenate(v) if v else np.empty(0, dtypes[k]) for k, v in parts.items()}
    if pairs is not None and manifest.store is not None:
        pairs = _index_pairs(build, manifest, flat["rows"], flat["lengths"])
    return summaries, flat, pairs


def _index_pairs(build: Path | ShardCache, manifest: Manifest, rows: np.ndarray, lengths: np.ndarray) -> PairCounts:
    """The counts of an index build of a pair store (`rows`, `lengths`: its packed documents', in pack order,
    groups whole): each document's prompt its group's in the store (`Store.prompt_lengths`, from the offsets and
    labels: no token id is read, and each document's labels only up to its first trained one), the rest of it
    its completion (truncation cuts completions alone)."""
    store = open_build_store(build, manifest) if isinstance(build, Path) else build.store()
    size = manifest.options.pairs.size
    if len(rows) and int(rows.max()) >= store.manifest.documents:
        raise FormatError(f"{build}: a pack holds store row {int(rows.max())}, but the store has {store.manifest.documents}; run `prepack verify`.")
    prompt = int(store.prompt_lengths()[rows // size].sum())
    units = lengths.reshape(-1, size).sum(axis=1)
    return PairCounts(len(lengths) // size, prompt, int(lengths.sum()) - prompt, int((units == manifest.options.max_len).sum()))


def _random_batch_cost(lengths: np.ndarray, batch_size: int, seed: int) -> int:
    """Padding to the longest document of each batch, batches drawn as a seeded shuffle."""
    shuffled = lengths[np.random.default_rng(seed).permutation(len(lengths))]
    starts = np.arange(0, len(shuffled), batch_size)
    sizes = np.diff(np.append(starts, len(shuffled)))
    return int((np.maximum.reduceat(shuffled, starts) * sizes).sum())


def _trl_pair_cost(pair_lengths: np.ndarray, batch_size: int, seed: int) -> int:
    """TRL's DPOTrainer batch of `batch_size` pairs: its 2 × batch_size documents padded to the longest of
    them (`DataCollatorForPreference`); batches drawn as a seeded shuffle of the pairs in corpus order. Groups
    ([N, G] lengths): G × batch_size documents so."""
    shuffled = pair_lengths[np.random.default_rng(seed).permutation(len(pair_lengths))]
    starts = np.arange(0, len(shuffled), batch_size)
    sizes = np.diff(np.append(starts, len(shuffled)))
    return int((np.maximum.reduceat(shuffled.max(axis=1), starts) * pair_lengths.shape[1] * sizes).sum())


def _step_balance(costs: np.ndarray, world_size: int, batch_size: int, token_cost: float, seed: int) -> StepBalance:
    unbalanced, balanced = epoch_imbalance(costs, world_size, batch_size, seed)
    return StepBalance(
        world_size=world_size,
        batch_size=batch_size,
        token_cost=token_cost,
        unbalanced_max_over_mean=unbalanced.max_over_mean,
        balanced_max_over_mean=balanced.max_over_mean,
        unbalanced_waiting_share=unbalanced.waiting_share,
        balanced_waiting_share=balanced.waiting_share,
    )


def inspect_build(
    path: str | os.PathLike,
    *,
    batch_size: int = 8,
    seed: int = 0,
    world_size: int | None = None,
    token_cost: float = DEFAULT_TOKEN_COST,
    cache_dir: str | os.PathLike | None = None,
    caps: Sequence[int] | None = None,
) -> InspectReport:
    """Report on the build at `path`, reading the manifest and the per-pack columns (and a preference-pair
    build's tokens and labels, whose pairs it counts: `prepack.check.pairs`).

    Costs, in token positions of compute (see `COST_NOTE`):
    - packed: packs * max_len;
    - pad_to_max_len: every document padded to max_len, documents * max_len;
    - pad_to_longest_in_batch: the documents in corpus order (source_rows, source_pieces), permuted by
      `numpy.random.default_rng(seed)`, cut into consecutive batches of `batch_size` (the last one
      partial), each costing its size times its longest document.
    "Documents" are the segments the packs hold: corpus documents after split/truncate/drop.
    With `world_size`, `steps` compares the ranks' work per step of `batch_size` packs each, as
    `PackedSampler(seed=seed, drop_last=True)` deals epoch 0, without and with `balance="attention"`.
    `caps` prices a few `--max-docs-per-pack K` (`CapCost`; default `DEFAULT_CAPS` below the build's fullest
    pack), so that a user can pick K for fixed-shape batches without building again.

    `path` may be a URI (`s3://bucket/packed`, needs `prepack-llm[s3]`): its shards are then downloaded
    into `cache_dir` and checked against the manifest's sha256 (`prepack.storage.cache`; when None, a
    temporary directory deleted before this returns).

    Raises FormatError when the build cannot be read or its columns disagree with its manifest
    (`verify_build` checks everything), InputError for a batch_size below 1.
    """
    if batch_size < 1:
        raise InputError(f"batch_size must be at least 1, got {batch_size}.")
    if world_size is not None and world_size < 1:
        raise InputError(f"world_size must be at least 1, got {world_size}.")
    try:
        caps = None if caps is None else [checked_cap(operator.index(k)) for k in caps]  # the planner's own rule
    except (TypeError, ValueError) as exc:
        raise InputError(f"caps {list(caps)}: {exc}.") from None
    try:
        token_cost = validated_token_cost(token_cost)
    except ValueError as exc:
        raise InputError(f"{exc}.") from None
    with ExitStack() as stack:
        build = stack.enter_context(build_cache(str(path), cache_dir)) if is_uri(path) else Path(path)
        manifest = build.manifest if isinstance(build, ShardCache) else read_manifest(build)
        summaries, columns, pairs = _read_columns(build, manifest)
    path = build.uri if isinstance(build, ShardCache) else build
    t, max_len = manifest.totals, manifest.options.max_len
    lengths = columns["lengths"]
    tokens, packs, segments = int(lengths.sum()), len(columns["tokens"]), len(lengths)
    claimed = {"packs": (t.packs, packs), "tokens": (t.tokens, tokens), "segments": (t.segments, segments)}
    for name, (said, found) in claimed.items():
        if said != found:
            raise FormatError(
                f"{path}: the manifest says {said} {name}, the shards hold {found}; run `prepack verify`."
            )
    if packs == 0:
        raise FormatError(f"{path}: the build holds no packs.")
    sources = None if manifest.mixture is None else _source_summaries(manifest, columns, path)

    # The random-batch baseline starts from corpus order, so it does not depend on the pack shuffle.
    order = np.lexsort((columns["pieces"], columns["rows"]))
    packed = packs * max_len

    def cost(total: int) -> Cost:
        return Cost(tokens=total, padding_tokens=total - tokens, ratio=total / packed)

    lower = -(-tokens // max_len)
    return InspectReport(
        path=str(path),
        max_len=max_len,
        overflow=manifest.options.overflow,
        has_labels=manifest.has_labels,
        documents=t.documents,
        input_tokens=t.input_tokens,
        segments=segments,
        tokens=tokens,
        packs=packs,
        shards=len(manifest.shards),
        fill=tokens / packed,
        padding_tokens=packed - tokens,
        lower_bound=lower,
        over_lower_bound=packs - lower,
        over_lower_bound_percent=100 * (packs - lower) / lower,
        empty=t.empty,
        split=t.split,
        split_pieces=t.split_pieces,
        truncated=t.truncated,
        truncated_tokens=t.truncated_tokens,
        dropped=t.dropped,
        dropped_tokens=t.dropped_tokens,
        untrained=t.untrained,
        untrained_tokens=t.untrained_tokens,
        drop_untrained=manifest.options.drop_untrained,
        documents_per_pack=_distribution(columns["docs"], _integer_edges(columns["docs"])),
        document_length=_distribution(lengths, _integer_edges(lengths)),
        pack_fill=_distribution(columns["tokens"] / max_len, np.linspace(0.0, 1.0, _FILL_BINS + 1)),
        batch_size=batch_size,
        seed=seed,
        cost=Costs(
            packed=cost(packed),
            pad_to_max_len=cost(segments * max_len),
            pad_to_longest_in_batch=cost(_random_batch_cost(lengths[order], batch_size, seed)),
        ),
        steps=None
        if world_size is None
        else _step_balance(pack_costs(columns["docs"], lengths, token_cost), world_size, batch_size, token_cost, seed),
        per_shard=summaries,
        sources=sources,
        pairs=None if pairs is None else _pair_report(manifest, pairs, lengths[order], batch_size, seed, cost, path),
        caps=None if manifest.mixture is not None else _cap_costs(manifest, lengths[order], columns["docs"], caps),
        appends=_append_report(manifest, tokens / packed),
    )


def _append_report(manifest: Manifest, fill: float) -> AppendReport | None:
    """A grown build's fill against a rebuild's (`REBUILD_GAIN_PP`), from its manifest's last generation."""
    if manifest.generations is None:
        return None
    last = manifest.generations[-1]
    rebuild_fill = last.tokens / (last.rebuild_packs * manifest.options.max_len)
    gap = 100 * (rebuild_fill - fill)
    return AppendReport(
        appends=len(manifest.generations) - 1, rebuild_packs=last.rebuild_packs, rebuild_fill=rebuild_fill,
        gap_pp=gap, rebuild_advised=gap > REBUILD_GAIN_PP,
    )


def _cap_costs(manifest: Manifest, lengths: np.ndarray, documents: np.ndarray, caps: Sequence[int] | None) -> list[CapCost]:
    """`CapCost` of each cap (`DEFAULT_CAPS` below the fullest pack when None), from the segment `lengths` in
    corpus order (a pair build's: chosen, rejected, pair after pair) and the build's `documents` per pack."""
    o, pairs = manifest.options, manifest.pairs is not None
    size = o.pairs.size if pairs else 1
    if caps is None:
        caps = [k for k in DEFAULT_CAPS if k < int(documents.max()) and k % size == 0]
    units = lengths.reshape(-1, size).sum(axis=1) if pairs else lengths
    out = []
    for k in sorted(set(caps)):
        # A pair is two documents: K // 2 pairs a pack, as the build plans them (K = 1 fits none); a group G.
        cap = k // size
        if cap < 1:
            continue
        packs = int(assign_packs(units, o.max_len, o.algorithm, max_documents=cap).max()) + 1
        out.append(
            CapCost(
                max_docs_per_pack=k,
                packs=packs,
                fill=int(lengths.sum()) / (packs * o.max_len),
                more_packs_percent=100 * (packs - len(documents)) / len(documents),
            )
        )
    return out


def _pair_report(manifest: Manifest, found: PairCounts, lengths: np.ndarray, batch_size: int, seed: int, cost, path) -> PairReport:
    """`found`: the pairs as the shards hold them (`_shard_pairs`; an unpaired build's labels counted too);
    `lengths`: the documents' lengths in corpus order, pair after pair (chosen, then rejected). The manifest's
    figures the shards disagree with are refused (FormatError: `verify` says more)."""
    p = manifest.pairs
    for field, message in pair_count_problems(p, found, manifest.options.overflow)[:1]:
        raise FormatError(f"{path}: the manifest's pairs.{field} {message[:-1]}; run `prepack verify`.")
    size = manifest.options.pairs.size
    pair_lengths = lengths.reshape(-1, size)
    unpaired = {"desirable": found.desirable, "undesirable": found.undesirable} if manifest.options.unpaired else {}
    return PairReport(
        **unpaired,
        pairs=len(pair_lengths),
        read=p.pairs,
        truncated=p.truncated,
        dropped=p.dropped,
        prompt_tokens=found.prompt_tokens,
        completion_tokens=found.completion_tokens,
        shared_prompt_saves=found.prompt_tokens // size * (size - 1),
        trl_padded=cost(_trl_pair_cost(pair_lengths, batch_size, seed)),
        group_size=manifest.options.pairs.group_size,
        scores_column=manifest.options.pairs.scores_column,
        ranks_column=manifest.options.pairs.ranks_column,
    )


def _source_summaries(manifest: Manifest, columns: dict[str, np.ndarray], path) -> list[SourceSummary]:
    """Per source of a mixture: its request, and its documents, segments and tokens in the packs, which
    must be the manifest's (else FormatError: `verify` says more)."""
    count = len(manifest.mixture.sources)
    ids = columns["sources"].astype(np.int64)
    if len(ids) and ids.max() >= count:
        raise FormatError(f"{path}: a pack names source {ids.max()}; the mixture has {count}; run `prepack verify`.")
    found = {
        "documents": np.bincount(ids[columns["pieces"] == 0], minlength=count),
        "segments": np.bincount(ids, minlength=count),
        "tokens": np.bincount(ids, weights=columns["lengths"], minlength=count).astype(np.int64),
    }
    total = int(columns["lengths"].sum())
    out = []
    for number, s in enumerate(manifest.mixture.sources):
        for name, values in found.items():
            if int(values[number]) != getattr(s, name):
                raise FormatError(
                    f"{path}: the manifest says source {s.name!r} has {getattr(s, name)} {name}, the shards hold "
                    f"{int(values[number])}; run `prepack verify`."
                )
        out.append(
            SourceSummary(
                name=s.name,
                requested_tokens=s.requested_tokens,
                requested_weight=s.requested_weight,
                full_epochs=s.full_epochs,
                partial_documents=s.partial_documents,
                documents=int(found["documents"][number]),
                segments=int(found["segments"][number]),
                tokens=int(found["tokens"][number]),
                weight=int(found["tokens"][number]) / total,
                trained_tokens=s.trained_tokens,
            )
        )
    return out


_BLOCKS = " ▁▂▃▄▅▆▇█"


def _as_pairs(pairs: PairReport) -> bool:
    """Whether messages call the build's units pairs (as `unit_name` does: a --pairs build, or a --groups build of
    2), which TRL's DPOTrainer pads as `_trl_pair_cost` counts."""
    return pairs.group_size in (None, 2)


def _sparkline(counts: list[int]) -> str:
    """One block per bin, each repeated so that every histogram is about _BINS characters wide."""
    top, repeat = max(counts) or 1, max(1, _BINS // len(counts))
    # Any non-empty bin gets at least the lowest block, so rare values stay visible.
    return "".join(_BLOCKS[math.ceil(c / top * (len(_BLOCKS) - 1))] * repeat for c in counts)


def _number(value: float, integer: bool) -> str:
    return f"{value:,.0f}" if integer else f"{value:.1%}"


def render(report: InspectReport, *, shards: bool = False) -> Group:
    """The report as rich tables (one screen); the per-shard table only when `shards`."""
    r = report
    summary = Table(title=f"prepack build {r.path}", show_header=False, title_justify="left", box=None)
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row(
        "documents",
        f"{r.documents:,} in the corpus, {r.segments:,} in the packs (after --overflow {r.overflow})",
    )
    summary.add_row(
        "tokens",
        f"{r.tokens:,} packed of {r.input_tokens:,} read" + (", with labels" if r.has_labels else ""),
    )
    summary.add_row(
        "packs", f"{r.packs:,} of {r.max_len:,} tokens in {r.shards:,} shard{'s' * (r.shards != 1)}"
    )
    summary.add_row(
        "over the lower bound",
        f"{r.over_lower_bound:,} packs ({r.over_lower_bound_percent:.3f}% over "
        f"ceil(tokens / max_len) = {r.lower_bound:,})",
    )
    summary.add_row("fill", f"{r.fill:.3%} ({r.padding_tokens:,} padding tokens)")
    if (a := r.appends) is not None:
        advice = (
            f"more than {REBUILD_GAIN_PP} points: rebuild (prepack build STORE --out NEW with the same options)"
            if a.rebuild_advised
            else f"within {REBUILD_GAIN_PP} points: keep appending"
        )
        summary.add_row(
            "appends",
            f"{a.appends:,}; a rebuild would take {a.rebuild_packs:,} packs, fill {a.rebuild_fill:.3%} "
            f"({a.gap_pp:+.3f} points), {advice}",
        )
    summary.add_row(
        "overflow",
        f"split {r.split:,} (into {r.split_pieces:,} pieces), truncated {r.truncated:,} "
        f"({r.truncated_tokens:,} tokens cut), dropped {r.dropped:,} ({r.dropped_tokens:,} tokens), "
        f"empty {r.empty:,}",
    )
    summary.add_row(
        "untrained",
        f"{r.untrained:,} documents with no trained token ({r.untrained_tokens:,} tokens), "
        + ("left out" if r.drop_untrained else "packed"),
    )

    distributions = Table(title="distributions", title_justify="left", box=box.SIMPLE_HEAD)
    distributions.add_column("")
    for name in ("min", "p50", "p90", "p99", "max", "mean"):
        distributions.add_column(name, justify="right")
    histograms = Table(title="histograms", title_justify="left", box=box.SIMPLE_HEAD)
    histograms.add_column("")
    histograms.add_column("from", justify="right")
    histograms.add_column("bins ... to", no_wrap=True)  # one cell: the upper label ends the last bin
    for name, dist, integer in (
        ("documents per pack", r.documents_per_pack, True),
        ("document length¹", r.document_length, True),
        ("pack fill", r.pack_fill, False),
    ):
        values = [_number(getattr(dist, k), integer) for k in ("min", "p50", "p90", "p99", "max")]
        mean = f"{dist.mean:,.1f}" if integer else f"{dist.mean:.1%}"
        distributions.add_row(name, *values, mean)
        low, high = dist.edges[0], dist.edges[-1] - (1 if integer else 0)
        histograms.add_row(name, _number(low, integer), f"{_sparkline(dist.counts)} {_number(high, integer)}")

    costs = Table(title="compute without packing²", title_justify="left", box=box.SIMPLE_HEAD)
    for name, justify in (("", "left"), ("tokens", "right"), ("padding", "right"), ("× packed", "right")):
        costs.add_column(name, justify=justify)
    for name, c in (
        ("packed", r.cost.packed),
        ("pad every document to max_len", r.cost.pad_to_max_len),
        (f"pad to longest, random batches of {r.batch_size}", r.cost.pad_to_longest_in_batch),
    ):
        costs.add_row(name, f"{c.tokens:,}", f"{c.padding_tokens:,}", f"{c.ratio:.2f}")
    if (pr := r.pairs) is not None:
        c = pr.trl_padded
        units = unit_name(pr.group_size or 2, plural=True)
        padded = "TRL DPOTrainer" if _as_pairs(pr) else "padded"
        costs.add_row(f"{padded}, random batches of {r.batch_size} {units}", f"{c.tokens:,}", f"{c.padding_tokens:,}", f"{c.ratio:.2f}")
        if pr.desirable is not None:  # an unpaired build: examples, each a completion and a KL completion
            units = "examples"
            summary.add_row("unpaired (KTO)", f"{pr.pairs:,} examples in the packs: {pr.desirable:,} desirable, "
                                              f"{pr.undesirable:,} undesirable; each with its KL completion")
        summary.add_row(
            units,
            f"{pr.pairs:,} in the packs of {pr.read:,} read (truncated {pr.truncated:,}, dropped {pr.dropped:,}); "
            f"prompt tokens {pr.prompt_tokens:,}, completion tokens {pr.completion_tokens:,}; a prompt stored once "
            f"would save {pr.shared_prompt_saves:,}",
        )
        values = [f"{kind} from column {column!r} ({field})" for kind, column, field in (
            ("scores", pr.scores_column, "group_scores"), ("ranks, 1 the best,", pr.ranks_column, "group_ranks")) if column is not None]
        if values:
            summary.add_row("per completion", "; ".join(values))

    notes = Text(
        "¹ documents are the segments in the packs (np.diff of cu_seqlens): corpus documents after split, "
        f"truncate or drop.\n² {COST_NOTE}"
        + ("\n³ PackedSampler's steps in epoch 0, mean over steps; time taken as proportional to cost." if r.steps else "")
        + (f"\nTRL DPOTrainer: the pairs in corpus order, shuffled with --seed, in batches of {r.batch_size} pairs whose "
           "chosen and rejected documents are padded together to the batch's longest (DataCollatorForPreference)."
           if r.pairs is not None and _as_pairs(r.pairs) else ""),
        style="dim",
    )
    parts = [summary, distributions, histograms, costs]
    if r.caps:
        capped = Table(title="--max-docs-per-pack K (fixed-shape batches), planned again", title_justify="left", box=box.SIMPLE_HEAD)
        for name in ("K", "packs", "fill", "more packs"):
            capped.add_column(name, justify="right")
        for c in r.caps:
            capped.add_row(f"{c.max_docs_per_pack:,}", f"{c.packs:,}", f"{c.fill:.2%}", f"{c.more_packs_percent:+.2f}%")
        parts.append(capped)
    if (s := r.steps) is not None:
        steps = Table(
            title=f"steps: {s.world_size} ranks × {s.batch_size} packs, cost Σ l² + {s.token_cost:,.0f} × tokens³",
            title_justify="left",
            box=box.SIMPLE_HEAD,
        )
        for name, justify in (("", "left"), ("slowest / mean rank", "right"), ("step time lost waiting", "right")):
            steps.add_column(name, justify=justify)
        steps.add_row("shuffled", f"{s.unbalanced_max_over_mean:.3f}", f"{s.unbalanced_waiting_share:.1%}")
        steps.add_row('balance="attention"', f"{s.balanced_max_over_mean:.3f}", f"{s.balanced_waiting_share:.1%}")
        parts.append(steps)
    if r.sources is not None:
        table = Table(title="sources (mixture)", title_justify="left", box=box.SIMPLE_HEAD)
        trained = r.sources[0].trained_tokens is not None  # the request counts trained tokens
        requested = ("requested trained tokens", "trained tokens") if trained else ("requested tokens",)
        for name in ("source", *requested, "tokens", "requested weight", "weight", "documents", "epochs"):
            table.add_column(name, justify="left" if name == "source" else "right")
        for s in r.sources:
            epochs = f"{s.full_epochs} + {s.partial_documents:,} docs"
            amounts = (f"{s.requested_tokens:,}", f"{s.trained_tokens:,}") if trained else (f"{s.requested_tokens:,}",)
            table.add_row(
                s.name, *amounts, f"{s.tokens:,}", f"{s.requested_weight:.4f}", f"{s.weight:.4f}",
                f"{s.documents:,}", epochs,
            )
        parts.append(table)
    if shards:
        table = Table(title="shards", title_justify="left", box=box.SIMPLE_HEAD)
        for name in ("name", "packs", "documents", "tokens", "bytes", "fill"):
            table.add_column(name, justify="left" if name == "name" else "right")
        for s in r.per_shard:
            table.add_row(
                s.name, f"{s.packs:,}", f"{s.documents:,}", f"{s.tokens:,}", f"{s.bytes:,}", f"{s.fill:.2%}"
            )
        parts.append(table)
    return Group(*parts, notes)


def plot(report: InspectReport, path: str | os.PathLike) -> Path:
    """Draw the three distributions and the cost comparison into one image at `path` (format from the
    suffix, e.g. .png or .svg). Raises MissingExtraError naming the `plot` extra when matplotlib is missing."""
    figure = _figure(report)
    path = Path(path)
    formats = figure.canvas.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:  # checked first: matplotlib would raise ValueError after drawing
        raise InputError(
            f"{path}: cannot draw a plot as {path.suffix or 'a file without a suffix'}; name it with one of "
            f"{', '.join('.' + f for f in sorted(formats))}."
        )
    with output_errors(path):  # a missing directory, a full disk
        figure.savefig(path, dpi=100)
    return path


def _figure(report: InspectReport):
    """The report's matplotlib Figure (not drawn yet)."""
    with optional_imports("plotting (inspect --plot)"):
        from matplotlib.figure import Figure  # the object API: no pyplot, no global backend switch
    figure = Figure(figsize=(12, 8), layout="constrained")
    axes = figure.subplots(2, 2)
    panels = (
        (axes[0, 0], report.documents_per_pack, "documents per pack", True),
        (axes[0, 1], report.document_length, "document length (segments, tokens)", True),
        (axes[1, 0], report.pack_fill, "pack fill", False),
    )
    for ax, dist, title, integer in panels:
        edges = np.asarray(dist.edges)
        ax.bar(edges[:-1], dist.counts, width=np.diff(edges), align="edge", edgecolor="white")
        stats = ", ".join(f"{k} {_number(getattr(dist, k), integer)}" for k in ("p50", "p90", "p99", "max"))
        ax.set_title(f"{title}\n{stats}", fontsize=10)  # on one line, long numbers ran off the figure
        ax.set_ylabel("count")
    ax = axes[1, 1]
    names = ["packed", "pad to max_len", f"pad to longest,\nbatches of {report.batch_size}"]
    costs = [report.cost.packed, report.cost.pad_to_max_len, report.cost.pad_to_longest_in_batch]
    bars = ax.barh(names, [c.tokens for c in costs], color=["tab:green", "tab:red", "tab:orange"])
    ax.bar_label(bars, labels=[f"{c.ratio:.2f}×" for c in costs], padding=3)
    ax.axvline(report.tokens, color="black", linestyle="--", linewidth=1, label="real tokens")
    ax.invert_yaxis()
    ax.margins(x=0.12)
    ax.set_xlabel("token positions of compute")
    ax.set_title("compute without packing", fontsize=10)
    ax.legend(loc="lower right")
    figure.suptitle(
        f"{report.path}: {report.packs:,} packs of {report.max_len:,}, fill {report.fill:.2%}, "
        f"{report.segments:,} documents"
    )
    return figure
