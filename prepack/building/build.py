"""The commands that read a corpus: `build` (corpus or document store in, shard directory out —
read → plan → write, with progress and a manifest) and `build_store` (`prepack tokenize`: a corpus in,
a document store out — its documents read and tokenized once, as `build` would read them, and written
in row order for any number of builds).

Each takes its options as keywords, gathered into typed option objects (`prepack.sources.documents.Reading`:
how the corpus is read; `Packing`: how documents become packs; `Output`: how and where shards are
written) that `build_packs` and `build_document_store` run on; `prepack build` and `prepack tokenize`
build the objects from their flags and call those.

Both check their options, choose an engine (`prepack.building.engines.base.Engine`: `prepack.building.engines.local`, or
`prepack.building.engines.ray` for `engine="ray"`) for the steps that touch tokens, and stage the output so
that nothing is published unless all of it is written. The plan is computed here, from the first
pass's lengths (`prepack.building.plan`: under 5 more bytes a segment, 4 more while planning); the engines'
docstrings say what memory their steps hold.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from prepack.sources.documents import Documents, Reading, open_documents, store_documents
from prepack.building.engines.base import ENGINES, Engine, FirstPass, locate_row
from prepack.building.engines.local import LocalEngine
from prepack.errors import DISTRIBUTION, InputError, require
from prepack.formats.shards import (
    MANIFEST_NAME,
    STORE_MANIFEST_NAME,
    BuildGeneration,
    BuildOptions,
    InputFile,
    Manifest,
    PairOptions,
    PairTotals,
    StoreReference,
    TokenizeOptions,
    Totals,
    store_path_problem,
    unit_name,
    write_manifest,
)
from prepack.storage.output import Staging, output_errors, staged_append, staged_directory
from prepack.building.pair_plan import PairPlan, first_overlong_pair, overlong_prompts, plan_pairs
from prepack.building import plan_vectorized
from prepack.building.plan import histogram_pairs, pack_count, pairs_histogram, plan_packs, segment_histogram
from prepack.storage.remote import fetch, is_uri, local_input, relative_location, staged_prefix
from prepack.formats.store import StoreManifest
from prepack.sources.store import Store, is_store
from prepack.building.write_store import finish_store
from prepack.building.mixture import Mixture, is_mixture_file, read_mixture

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

__all__ = ["DEFAULT_SHARD_SIZE", "Output", "Packing", "build", "build_document_store", "build_packs", "build_store", "progress_bars"]

# Bytes. ~1,300 full 8k-token packs. Each of the local engine's shard writers holds a shard's columns while it
# writes it, and those pages are new to the process: at 256 MiB the shard pass took half as long
# again as at 64 MiB on the benchmark machine, and held 4x the memory. 64 MiB is also MosaicML
# streaming's default shard size; a billion 350-token documents make ~33k shards.
DEFAULT_SHARD_SIZE = 64 * 2**20

_Options = TypeVar("_Options")


@dataclass(frozen=True, kw_only=True)
class Packing:
    """How `build` packs the documents it reads (with `prepack.sources.documents.Reading`, how it reads them):
    `max_len` tokens a pack, by `algorithm` ("ffd", "bfd"), documents longer than it handled by
    `overflow` ("split", "truncate", "drop", "error"), the packs shuffled with `seed`; with
    `drop_untrained`, documents with no trained token left out; with `index_only` (a store only),
    index shards written instead of token shards; with `max_docs_per_pack`, at most that many documents
    (segments; a preference pair counts as its two) a pack, for fixed-shape batches; with
    `max_images_per_pack`, at most that many images a pack, each corpus row counting its images in the image
    set at `images` (`prepack prepare-images`), by first-fit-decreasing."""

    max_len: int
    algorithm: str = "ffd"
    overflow: str = "split"
    seed: int = 0
    drop_untrained: bool = False
    index_only: bool = False
    max_docs_per_pack: int | None = None
    max_images_per_pack: int | None = None
    images: str | os.PathLike | None = None

    def manifest_options(self, shard_size: int, column: str, labels_column: str | None, image_set: str | None = None) -> BuildOptions:
        """The manifest's `options` for these packing options and the shards' size, the documents read
        from `column` (and labels from `labels_column`). Raises pydantic's ValidationError (a ValueError)."""
        return BuildOptions(
            max_len=self.max_len,
            algorithm=self.algorithm,
            overflow=self.overflow,
            seed=self.seed,
            shard_size=shard_size,
            column=column,
            labels_column=labels_column,
            drop_untrained=self.drop_untrained,
            max_docs_per_pack=self.max_docs_per_pack,
            max_images_per_pack=self.max_images_per_pack,
            image_set=image_set,
        )


@dataclass(frozen=True, kw_only=True)
class Output:
    """How `build` and `build_store` write their output: shards of about `shard_size` bytes, replacing
    what is at the output with `overwrite`, by the engine named `engine` ("local", or "ray" on the
    cluster at `ray_address`), with progress bars on `console` (stderr when None) when `progress`. With
    `append`, the output at `out` is grown instead (`build_packs`, `build_document_store`)."""

    shard_size: int = DEFAULT_SHARD_SIZE
    overwrite: bool = False
    append: bool = False
    engine: str = "local"
    ray_address: str | None = None
    progress: bool = False
    console: Console | None = None


def _store_path(store: str | os.PathLike, out: str | os.PathLike) -> str:
    """How an index build at `out` names its store: relative to `out`, so that moving both together
    keeps the build readable. Refused (InputError), before anything is read or written, unless readers
    accept it: the store must lie in the build's parent directory (prefix); a local one by its real path,
    which passes through no symbolic link (readers refuse one: `store_location_problem`)."""
    if is_uri(store) or is_uri(out):
        relative = relative_location(str(store), str(out))
    else:
        relative = Path(os.path.relpath(os.path.realpath(store), os.path.realpath(out))).as_posix()
    if (problem := store_path_problem(relative)) is not None:
        raise InputError(
            f"{out}: an index build must lie beside its store, in the directory (or prefix) that holds "
            f"{store}, as readers refuse a store elsewhere; its path from the build would be {relative!r}, which "
            f"{problem}. Choose --out in that directory (a store that moves later is named at load time: "
            "PackedDataset(build, store=...), prepack verify --store)."
        )
    return relative


def _check_engine(engine: str, ray_address: str | None, reading: Reading) -> None:
    """Refuse an engine prepack does not have, options that the engine would ignore, and the ray
    engine without ray installed; before anything is read."""
    if engine not in ENGINES:
        raise InputError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}.")
    if engine == "local":
        if ray_address is not None:
            raise InputError("--ray-address joins a Ray cluster: use it with --engine ray.")
        return
    if reading.num_proc is not None:
        raise InputError(
            "--num-proc sets the local engine's tokenizer threads or processes; with --engine ray every task "
            "tokenizes on one core, and the cluster's CPUs set how many run at once."
        )
    engine_ray = require("prepack.building.engines.ray", "--engine ray")  # ray is imported only for this engine
    engine_ray.check_ray_address(ray_address)  # before anything is read or written


@contextmanager
def _engine(engine: str, ray_address: str | None, staging: Staging, index_only: bool = False) -> Iterator[Engine]:
    """The engine named `engine` (checked by `_check_engine`) for the output written into `staging`:
    for "ray", a `prepack.building.engines.ray.RayEngine` connected for it. An index build reads no token and
    writes small shards, planning only: every engine runs it here, with a `LocalEngine`."""
    if engine == "local" or index_only:
        yield LocalEngine(staging, index_only)
        return
    from prepack.building.engines.ray import ray_engine

    with ray_engine(ray_address, staging) as ray_session:
        yield ray_session


class _NoProgress:
    """The progress a command reports where it shows none: the calls of rich's `Progress` that the
    build path makes, doing nothing, so that a quiet build does not import rich (0.03 CPU s,
    `python benchmarks/bench_startup.py` times such builds)."""

    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def add_task(self, *args: object, **kwargs: object) -> int:
        return 0

    def update(self, *args: object, **kwargs: object) -> None:
        return None

    advance = update


def progress_bars(enabled: bool, console: Console | None) -> Progress:
    """The progress bars of a long command (`build`, `build_store`, `write_reference_logps`), when `enabled`."""
    if not enabled:
        return _NoProgress()  # type: ignore[return-value]  # what the engines call of a Progress
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(SpinnerColumn(), *columns, console=console)


def _gathered(options: type[_Options], keywords: dict[str, Any]) -> _Options:
    """The option object of class `options` (a dataclass: `Reading`, `Packing`, `Output`) that a keyword
    wrapper (`build`, `build_store`) was called with: each field the keyword argument of its name, so
    that every option is named in the signature and in its class, and nowhere else."""
    return options(**{field.name: keywords[field.name] for field in fields(options)})


def build(
    corpus: str | os.PathLike,
    out: str | os.PathLike,
    *,
    max_len: int,
    column: str = "input_ids",
    labels_column: str = "labels",
    tokenizer: str | os.PathLike | None = None,
    chat: bool = False,
    text_column: str = "text",
    messages_column: str = "messages",
    eos: bool = True,
    chat_template: str | os.PathLike | None = None,
    train_on: str = "assistant",
    num_proc: int | None = None,
    pairs: bool = False,
    prompt_column: str = "prompt",
    chosen_column: str = "chosen",
    rejected_column: str = "rejected",
    groups: bool = False,
    completions_column: str = "completions",
    scores_column: str | None = None,
    ranks_column: str | None = None,
    unpaired: bool = False,
    completion_column: str = "completion",
    label_column: str = "label",
    kl_seed: int = 0,
    algorithm: str = "ffd",
    overflow: str = "split",
    seed: int = 0,
    shard_size: int = DEFAULT_SHARD_SIZE,
    drop_untrained: bool = False,
    index_only: bool = False,
    max_docs_per_pack: int | None = None,
    max_images_per_pack: int | None = None,
    images: str | os.PathLike | None = None,
    overwrite: bool = False,
    append: bool = False,
    engine: str = "local",
    ray_address: str | None = None,
    progress: bool = False,
    console: Console | None = None,
) -> Manifest:
    """Pack a corpus, or a document store (`build_store`), into shards under `out` and return the
    manifest written there. A store's documents are not tokenized again: its build is byte for byte
    the build of its corpus with the options the store was tokenized with, which it records.

    >>> manifest = build("corpus.parquet", "packed/", max_len=8192)   # doctest: +SKIP
    >>> manifest.totals.packs, manifest.totals.padding_tokens           # doctest: +SKIP
    >>> build("chats.jsonl", "sft/", max_len=8192, tokenizer="./tok", chat=True)  # doctest: +SKIP

    With `index_only` (a store only) the shards are index shards: which documents each pack holds,
    no token; the manifest names the store by its path relative to `out` and its fingerprint, and
    `PackedDataset` gathers the packs' tokens from the store.

    Documents with no trained token (every label after the first -100) are counted in the
    manifest's totals (`untrained`) and, with `drop_untrained`, left out of the packs.

    `max_docs_per_pack` caps the documents (segments) of a pack beside `max_len`, planned exactly by the
    same algorithm under both limits, so that every batch of `prepack.training.collate.PackedCollator` with
    `fixed_shape=True` has the same shapes (`torch.compile`, CUDA graphs). A preference pair counts as its two
    documents. Recorded in the manifest and held by `verify`; without it the build is that of before.
    `max_images_per_pack` caps the images of a pack the same way (first-fit-decreasing only), each corpus row
    counting its images in `images`, the image set `prepack.sources.images.prepare_image_chat` wrote with the
    corpus (a vision tower's memory follows its images, not the text tokens). A row with more images than the
    cap is refused by file and row: no pack could hold it, and splitting or truncating it would cut images from
    their placeholders. Recorded in the manifest with the image set's sha256, held by `verify --images`.

    Without `tokenizer` the corpus holds token ids in `column`, and `labels_column` is carried into
    the shards when every corpus file has it. With `tokenizer` (a local directory or tokenizer.json)
    the corpus holds text in `text_column`, or with `chat` conversations in `messages_column`,
    tokenized as `prepack.sources.tokenize.tokenize_corpus` describes (`eos`, `chat_template`, `train_on`,
    `num_proc`). With `pairs`, the corpus holds preference pairs (`prepack.sources.pairs`: `prompt_column`,
    `chosen_column`, `rejected_column`), text or with `chat` conversations, each pair packed as a unit
    (`prepack.building.pair_plan`; `overflow` "truncate", "drop" or "error"), its shards carrying `pair_roles`.
    With `groups`, a prompt (`prompt_column`) and a list of G completions (`completions_column`) a row, each group
    packed as a unit of G documents the same way (roles 0 … G - 1). A group build with `scores_column` (a list of G
    finite numbers a row) or `ranks_column` (G integers, 1 the best, a competition ranking: ties allowed) stores each
    completion's value beside its document (`group_scores`, `group_ranks`), which `PackedCollator` hands on. With
    `unpaired`, unpaired feedback (KTO, TRL's format: `prompt_column`, `completion_column`, `label_column` a boolean,
    true for desirable) is packed as units of 2 documents, the example's completion and its KL completion (another
    example's, planned from `kl_seed`: `prepack.sources.pairs.unpaired_documents`), the shards carrying each example's
    label (`desirable`).

    `engine="ray"` reads, tokenizes and writes shards as Ray tasks (`prepack.building.engines.ray`; needs
    `prepack-llm[ray]`), on the cluster at `ray_address` ("auto", "ray://…"), or on the Ray instance this
    process is connected to, or at `RAY_ADDRESS`, or on a new local one; the output is byte for byte
    the local engine's.
    With `append` (`corpus` a document store grown since the build at `out` was made from it: `build_store`'s
    `append`), only the store's documents the build does not hold yet are planned and packed, into new
    shards after the build's, which stay byte for byte as they are; the options must be the build's. The
    manifest's `generations` record each append and the packs a rebuild would take.

    Raises `InputError` for bad input, and `OutputError` when `out` cannot be written as
    asked (see `prepack.storage.output.staged_directory`: it exists without `overwrite`, it is not a prepack
    build, another build to it runs, a disk is full); in every case nothing is published.
    """
    keywords = locals()
    return build_packs(corpus, out, _gathered(Reading, keywords), _gathered(Packing, keywords), _gathered(Output, keywords))


def build_packs(
    corpus: str | os.PathLike | Mixture, out: str | os.PathLike, reading: Reading, packing: Packing, output: Output
) -> Manifest:
    """`build`, with its options gathered: how the corpus is read, how its documents are packed and
    how the shards are written (what `prepack build` parses its flags into). `corpus` may be a
    mixture file or a `Mixture` (`prepack build --source …`)."""
    max_len, overflow, index_only = packing.max_len, packing.overflow, packing.index_only
    image_counts, image_set_sha256 = _image_cap(corpus, reading, packing, output)
    try:
        options = packing.manifest_options(output.shard_size, reading.read_column, reading.labels_column, image_set_sha256)
    except ValueError as exc:
        raise InputError(f"invalid build options:\n{exc}") from None
    _check_engine(output.engine, output.ray_address, reading)
    _check_append(output)
    if isinstance(corpus, Mixture) or is_mixture_file(corpus):  # several corpora or stores, weighted (prepack.building.mixture)
        if output.append:
            raise InputError(f"{corpus}: --append grows the build of one document store; a mixture is built whole.")
        mixture = corpus if isinstance(corpus, Mixture) else read_mixture(corpus)
        if reading.pairs or reading.groups or reading.unpaired:
            raise InputError(f"{corpus}: a mixture of preference-pair, group or unpaired corpora is not supported; build each on its own.")
        from prepack.building.mixture_build import build_mixture

        with progress_bars(output.progress, output.console) as bar:
            return build_mixture(mixture, out, reading, packing, output, bar, _store_path, _engine)
    if reading.pairs or reading.groups or reading.unpaired:
        _check_pair_options(packing, output, "--groups" if reading.groups else "--unpaired" if reading.unpaired else "--pairs")
    with progress_bars(output.progress, output.console) as bar, local_input(corpus) as source:
        if index_only and not is_store(source.spec):
            raise InputError(
                f"{corpus}: --index-only packs a document store, and this is a corpus: make one with "
                f"`prepack tokenize {corpus} --out STORE`, then `prepack build STORE --index-only`."
            )
        if output.append and not is_store(source.spec):
            raise InputError(
                f"{corpus}: --append grows the build of a document store by the documents added to it since; this is "
                f"a corpus: tokenize it into a store (prepack tokenize), grow that with `prepack tokenize NEW --out "
                "STORE --append`, and build from the store."
            )
        store_path = _store_path(corpus, out) if index_only else None  # refuses a store the build cannot name
        documents = open_documents(source.spec, reading, out, bar, source.location)
        if documents.pairs is not None:  # its group size is known now (a group corpus's first row), before any row is read
            if documents.store is not None:  # a pair store's options, as --pairs's or --groups's
                _check_pair_options(packing, output, f"--{documents.pairs.options.kind}")
            _check_pairs_cap(documents.pairs.options, packing.max_docs_per_pack)
        store = documents.store
        with (
            _staged(out, output) as staging,
            _engine(output.engine, output.ray_address, staging, index_only) as engine_steps,
        ):
            if (appending := staging.appending) is not None:
                planned = _planned_generation(appending, store, options, index_only, out)
                if planned == len(store.manifest.generations or [None]) - 1:  # nothing added since
                    with output_errors(staging.build / MANIFEST_NAME):
                        write_manifest(staging.build, appending)
                    return appending
                documents = store_documents(replace(store, manifest=store.manifest.since_generation(planned)))
            found, has_labels, read_column = documents.corpus, documents.has_labels, documents.column
            first = engine_steps.first_pass(documents, reading, bar)
            if store is not None:
                _check_store_fingerprints(store, first)
            if len(first.lengths) == 0:
                raise InputError(f"{corpus}: the corpus has no documents.")
            # An append whose documents give no pack still records them (a generation of no new shard).
            if not first.lengths.any() and appending is None:
                raise InputError(f"{corpus}: all {len(first.lengths)} documents are empty.")
            if image_counts is not None:
                _check_image_counts(image_counts, packing, documents, first)
            if documents.pairs is None and overflow == "error" and (first.lengths > max_len).any():
                row = int(np.flatnonzero(first.lengths > max_len)[0])
                path, file_row = locate_row(found, first.rows_per_file, row)
                raise InputError(
                    f"{path}, row {file_row}, column {read_column!r}: {first.lengths[row]} tokens, "
                    f"longer than --max-len {max_len} (choose --overflow split, truncate or drop)."
                )
            # An index build plans as its first pass read (`plans_in_numpy`, on the tokens of the documents it
            # reads: an append's, the new ones'; its count of a rebuild's packs chooses apart: `pack_count`,
            # `plan_vectorized.counts_in_numpy`).
            without_numba = index_only and plan_vectorized.plans_in_numpy(documents.store.manifest.tokens, has_labels)
            planning = bar.add_task("plan", total=None)
            if documents.pairs is not None:
                plan = _plan_pairs(documents, first, packing)
            else:
                plan = plan_packs(
                    first.lengths,
                    max_len,
                    algorithm=packing.algorithm,
                    overflow=overflow,
                    seed=packing.seed,
                    untrained=first.untrained,
                    drop_untrained=packing.drop_untrained,
                    max_documents=packing.max_docs_per_pack,
                    without_numba=without_numba,
                    images=image_counts,
                    max_images=packing.max_images_per_pack,
                )
            bar.update(planning, total=1, completed=1)
            if plan.packs == 0 and appending is None:  # every non-empty document was left out
                raise InputError(
                    f"{corpus}: no document is left to pack: of the non-empty documents, "
                    f"{plan.counts['dropped']:,} are longer than --max-len {max_len} (--overflow drop) and "
                    f"{plan.counts['untrained']:,} have no trained token (--drop-untrained)."
                )
            shards = engine_steps.write_packs(plan, first, output.shard_size, bar) if plan.packs else []
            manifest = Manifest(
                prepack_version=version(DISTRIBUTION),
                # How the documents were read: as asked, or as the store was written.
                options=options.model_copy(
                    update={
                        "column": read_column,
                        "labels_column": documents.labels_column,
                        "tokenize": documents.tokenize,
                        "pairs": documents.pairs.options if documents.pairs is not None else None,
                    }
                ),
                has_labels=has_labels,
                # A store's as its first pass recomputed it (a grown one's chained: `StoreFingerprint`), held to store.json's above.
                fingerprint=first.fingerprint,
                inputs=[
                    InputFile(path=found.name(path), rows=rows)
                    for path, rows in zip(found.files, first.rows_per_file)
                ],
                totals=Totals(**plan.totals(), documents=len(first.lengths)),
                shards=shards,
                store=StoreReference(path=store_path, fingerprint=first.fingerprint) if index_only else None,
                pairs=PairTotals(**plan.pair_counts) if documents.pairs is not None else None,
                # What an append counts a rebuild's packs from. Not in a full build (until appended to), which stays
                # byte for byte the build of the store's corpus: its first append reads the old shards' offsets.
                # An append's are its rebuild's (`_grown_manifest`).
                segment_lengths=histogram_pairs(plan.histogram) if index_only and documents.pairs is None and appending is None else None,
            )
            if appending is not None:
                rebuild = _rebuild_histogram(appending, store, planned, plan.histogram, packing, out)
                manifest = _grown_manifest(appending, manifest, rebuild, packing)
            with output_errors(staging.build / MANIFEST_NAME):
                write_manifest(staging.build, manifest)
    return manifest


# The options an append must share with the build it grows, by the flag that sets each.
_APPEND_OPTIONS = {"max_len": "--max-len", "algorithm": "--algorithm", "overflow": "--overflow", "seed": "--seed",
                   "shard_size": "--shard-size", "drop_untrained": "--drop-untrained", "max_docs_per_pack": "--max-docs-per-pack"}


def _planned_generation(build: Manifest, store: Store, options: BuildOptions, index_only: bool, out: str | os.PathLike) -> int:
    """The generation of `store` that the build at `out` (its manifest `build`) holds the documents of,
    after refusing (InputError) an append with other options than the build's, or to a build that is
    not one of this store."""
    if build.mixture is not None or build.pairs is not None:
        raise InputError(f"{out} is a {'mixture' if build.mixture is not None else 'preference-pair'} build, which is built whole: --append grows the build of one document store.")
    if (build.store is not None) != index_only:
        raise InputError(f"{out} is {'an index' if build.store is not None else 'a full'} build: append to it {'with' if build.store is not None else 'without'} --index-only.")
    for name, flag in _APPEND_OPTIONS.items():
        if getattr(options, name) != (was := getattr(build.options, name)):
            raise InputError(f"{flag} {getattr(options, name)!r}, but {out} was built with {was!r}: an append packs as the build did.")
    m = store.manifest
    generation = m.generation_of(build.fingerprint)
    at = m.at_generation(generation) if generation is not None else None
    if at is None or [(f.path, f.rows) for f in at.inputs] != [(f.path, f.rows) for f in build.inputs]:
        raise InputError(
            f"{out} was not built from this store (or from any generation of it: fingerprint {build.fingerprint}); "
            f"--append grows a build by the documents appended to its own store since."
        )
    return generation


def _check_store_fingerprints(store: Store, first: FirstPass) -> None:
    """Refuse (InputError) a store whose documents do not give a fingerprint its store.json records: at
    each generation the first pass hashed (`FirstPass.generations`), else (an index build's, which
    hashes nothing) the last. Each link, not the last alone: a generation's shard swapped under a last
    link recomputed for the swap leaves the chain ending right, and that generation's index builds
    reading other tokens than they were planned from."""
    m = store.manifest
    recorded = [g.fingerprint for g in m.generations] if m.generations is not None else [m.fingerprint]
    found = first.generations or (first.fingerprint,)
    for number, (was, now) in enumerate(zip(recorded[-len(found):], found), start=len(recorded) - len(found)):
        if was != now:
            field = "fingerprint" if m.generations is None else f"generations[{number}].fingerprint"
            raise InputError(
                f"{store.location or store.root}/{STORE_MANIFEST_NAME}: {field} is {was}, but the store's documents "
                f"give {now}: its documents or store.json changed after the store was written."
            )


def _rebuild_histogram(
    build: Manifest, store: Store, planned: int, added: np.ndarray, packing: Packing, out: str | os.PathLike
) -> np.ndarray:
    """The segment histogram of a build of the whole grown store at once: the store's documents of
    generation `planned` and before, then those just planned (`added`, their plan's histogram). The build's
    `segment_lengths` record the first part (validated by the Manifest model: lengths within max_len, counts
    and tokens the totals'), and it is held to the store: its segments are pieces of the store's documents
    of generation `planned`, so no more tokens than store.json gives them, and none longer than its longest
    document (else InputError): the histogram is as long as its longest segment, which max_len (up to 2**31 - 1)
    and the totals alone would let a forged record make as long as the store's tokens. The longest document is
    the last of store.json's `length_counts` (the whole store's: stores only grow, so none shorter than the
    longest of generation `planned`). A build without the record (a full build before its first append, or one
    made before builds recorded it), or of a store that records no `length_counts` (one grown before stores
    recorded them), has the old store shards' offsets read instead (`_stored_histogram`)."""
    length_counts = store.manifest.length_counts
    if build.segment_lengths is None or length_counts is None:
        old = _stored_histogram(store, planned, packing)
    else:
        tokens = int(build.totals.tokens)
        if tokens > (held := store.manifest.at_generation(planned).tokens):
            raise InputError(
                f"{out}/{MANIFEST_NAME}: segment_lengths (and totals.tokens) hold {tokens} tokens, more than the "
                f"{held} of the store's documents it was built from: the manifest was changed after the build."
            )
        if build.segment_lengths and (longest := build.segment_lengths[-1][0]) > (document := length_counts[-1][0]):
            raise InputError(
                f"{out}/{MANIFEST_NAME}: segment_lengths record a segment of {longest} tokens, longer than the longest "
                f"document of its store ({document} tokens, store.json's length_counts): manifest.json or store.json "
                "changed after they were written."
            )
        old = pairs_histogram(build.segment_lengths)
    return _added_histograms(old, added)


def _added_histograms(histogram: np.ndarray, part: np.ndarray) -> np.ndarray:
    """The sum of two segment histograms (int64), as long as the longer: `histogram` itself, added to in place,
    where it is the longer (the callers' own)."""
    if len(part) > len(histogram):
        histogram = np.concatenate([histogram, np.zeros(len(part) - len(histogram), np.int64)])
    histogram[: len(part)] += part
    return histogram


def _stored_histogram(store: Store, planned: int, packing: Packing) -> np.ndarray:
    """The segment histogram of a build of the store's documents of generation `planned` and before, from
    their shards (for a build that records no `segment_lengths`), added up shard by shard: one shard's
    lengths held at a time. The offsets give the lengths (no token read; the labels only when untrained
    documents are left out, as only then do they change the segments, read as an index build of them would:
    `plans_in_numpy`), each shard's checked against its store.json entry (`check_store_offsets`). Not
    store.json's `length_counts`, which nothing ties to the shards (verify holds them to the offsets)."""
    old = store.manifest.at_generation(planned)
    histogram = np.zeros(1, np.int64)  # as long as the longest segment yet: not max_len, which may be 2**31 - 1

    def add(lengths: np.ndarray, untrained: np.ndarray | None) -> None:
        nonlocal histogram
        histogram = _added_histograms(histogram, segment_histogram(
            lengths, packing.max_len, overflow=packing.overflow, untrained=untrained, drop_untrained=packing.drop_untrained))

    if packing.drop_untrained:
        without_numba = plan_vectorized.plans_in_numpy(old.tokens, old.has_labels)
        for shard in old.shards:
            add(*store.shard_lengths(shard, without_numba))
    else:
        for shard in old.shards:
            add(store.shard_document_lengths(shard), None)
    return histogram


def _grown_manifest(build: Manifest, added: Manifest, rebuild: np.ndarray, packing: Packing) -> Manifest:
    """The manifest of the build `build` grown by `added` (the manifest of the new shards alone): its
    inputs, shards and totals after the build's, the fingerprint and store of `added`, one more generation,
    whose `rebuild_packs` a build of all the documents at once would take: the packs that plan of the segments
    `rebuild` counts (`pack_count`, no segment placed), which the manifest records as `segment_lengths`."""
    rebuild_packs = pack_count(rebuild, packing.max_len, algorithm=packing.algorithm, max_documents=packing.max_docs_per_pack)
    totals = {name: getattr(build.totals, name) + getattr(added.totals, name) for name in Totals.model_fields}
    totals["lower_bound"] = -(-totals["tokens"] // build.options.max_len)
    inputs, shards = [*build.inputs, *added.inputs], [*build.shards, *added.shards]
    first = BuildGeneration(
        documents=build.totals.documents, inputs=len(build.inputs), shards=len(build.shards), packs=build.totals.packs,
        tokens=build.totals.tokens, rebuild_packs=build.totals.packs, fingerprint=build.fingerprint,
    )
    grown = BuildGeneration(
        documents=totals["documents"], inputs=len(inputs), shards=len(shards), packs=totals["packs"],
        tokens=totals["tokens"], rebuild_packs=rebuild_packs, fingerprint=added.fingerprint,
    )
    generations = [*(build.generations or [first]), grown]
    return Manifest(**{**dict(added), "inputs": inputs, "shards": shards, "totals": Totals(**totals), "generations": generations,
                       "segment_lengths": histogram_pairs(rebuild)})


def _image_cap(corpus, reading: Reading, packing: Packing, output: Output) -> tuple[np.ndarray | None, str | None]:
    """The image count of every corpus row and the sha256 of the image set's images.json, when the build caps
    images a pack (else None, None); before anything else is read, refused (InputError) where the cap cannot be
    planned: without its image set, with options it does not combine with."""
    cap, images = packing.max_images_per_pack, packing.images
    if cap is None:
        if images is not None:
            raise InputError("--images names the image set whose image counts --max-images-per-pack caps: give both, or neither.")
        return None, None
    if type(cap) is not int or not 1 <= cap < 2**31:
        raise InputError(f"--max-images-per-pack {cap!r}: give an integer in [1, 2**31).")
    if images is None:
        raise InputError(f"--max-images-per-pack {cap} counts every row's images in the corpus's image set "
                         "(prepack prepare-images wrote it as images/ beside corpus.parquet): give it with --images DIR.")
    refused = [flag for flag, given in (("--algorithm bfd", packing.algorithm == "bfd"), ("--append", output.append),
               ("--pairs", reading.pairs), ("--groups", reading.groups), ("--unpaired", reading.unpaired),
               ("a mixture", isinstance(corpus, Mixture) or is_mixture_file(corpus))) if given]
    if refused:
        raise InputError(f"--max-images-per-pack plans one image-chat corpus by first-fit-decreasing, whole: leave out {refused[0]}.")
    if is_uri(images):
        raise InputError(f"--images {images}: an image set is a local directory.")
    from prepack.formats.images import read_image_set

    image_set = read_image_set(images)  # FormatError naming file, row and column
    return image_set.row_images(), image_set.manifest_sha256


def _check_image_counts(counts: np.ndarray, packing: Packing, documents: Documents, first: FirstPass) -> None:
    """Refuse (InputError) an image set that is not the corpus's, and a row with more images than the cap, by file and row."""
    if len(counts) != len(first.lengths):
        raise InputError(f"--images {packing.images} describes {len(counts)} corpus rows; the corpus has {len(first.lengths)}: "
                         "not the image set of this corpus.")
    if (counts > packing.max_images_per_pack).any():
        row = int(np.argmax(counts > packing.max_images_per_pack))
        path, file_row = locate_row(documents.corpus, first.rows_per_file, row)
        raise InputError(
            f"{path}, row {file_row}: {counts[row]} images (in --images {packing.images}), more than "
            f"--max-images-per-pack {packing.max_images_per_pack}: no pack can hold it, and splitting or truncating the "
            "sample would cut images from their placeholders; raise the cap or leave the row out of the corpus."
        )


def _check_pair_options(packing: Packing, output: Output, flag: str) -> None:
    """Refuse, before anything is read, the options a preference-pair (`flag` --pairs) or group (--groups) build
    cannot honour."""
    if packing.overflow == "split":
        what = {"--pairs": "a pair (both documents go", "--groups": "a group (its documents all go",
                "--unpaired": "an example (its completion and KL completion go"}[flag]
        raise InputError(
            f"{flag} never splits {what} into one pack): choose --overflow truncate (cut the "
            "completions), drop or error."
        )
    if packing.drop_untrained:
        raise InputError(f"--drop-untrained would break {flag[2:]} apart: leave it out with {flag}.")
    if flag == "--unpaired" and output.engine != "local":  # the KL plan pairs examples across the whole corpus
        raise InputError("--unpaired builds run on the local engine (each example's KL completion is planned over "
                         "the whole corpus, read in one process; pairs and groups run on Ray too): leave out --engine ray.")


def _check_pairs_cap(options: PairOptions, cap: int | None) -> None:
    """Refuse a --max-docs-per-pack below the documents of one pair or group, which no pack could hold."""
    if cap is not None and cap < options.size:
        raise InputError(f"--max-docs-per-pack {cap} leaves no room for a {options.unit}'s {options.size} documents: "
                         f"give {options.size} or more.")


def _plan_pairs(documents: Documents, first: FirstPass, packing: Packing) -> PairPlan:
    """The plan of a preference-pair build, after refusing what `packing.overflow` refuses, by file and row."""
    prompt_lengths, max_len = documents.pairs.prompt_lengths(), packing.max_len
    size = documents.pairs.options.size
    refused = None
    if packing.overflow == "error" and (pair := first_overlong_pair(first.lengths, max_len, size)) is not None:
        tokens = int(first.lengths[size * pair : size * (pair + 1)].sum())
        what = {"pairs": "the pair's {} tokens (prompt + chosen, prompt + rejected)", "groups": "the group's {} tokens (prompt + each completion)",
                "unpaired": "the example's {} tokens (prompt + completion, prompt + KL completion)"}[documents.pairs.options.kind]
        refused = pair, (
            f"{what.format(tokens)} are longer than --max-len {max_len} "
            "(choose --overflow truncate or drop)"
        )
    elif packing.overflow == "truncate" and len(over := overlong_prompts(first.lengths, prompt_lengths, max_len, size)):
        times = "twice" if size == 2 else f"{size} times"
        refused = int(over[0]), (
            f"the {unit_name(size)}'s prompt of {int(prompt_lengths[over[0]])} tokens, {times}, leaves no room in --max-len {max_len} "
            "for one completion token each (choose --overflow drop, or a larger --max-len)"
        )
    if refused is not None:
        pair, why = refused
        path, row = locate_row(documents.corpus, first.rows_per_file, size * pair)
        raise InputError(f"{path}, row {row // size}: {why}.")
    values = documents.pairs.group_values()  # a group build's scores and ranks, one a document, stored beside it
    return plan_pairs(
        first.lengths,
        prompt_lengths,
        max_len,
        algorithm=packing.algorithm,
        overflow=packing.overflow,
        seed=packing.seed,
        untrained=first.untrained,
        max_pairs=None if packing.max_docs_per_pack is None else packing.max_docs_per_pack // size,
        size=size,
        desirable=documents.pairs.desirable,
        scores=values.scores,
        ranks=values.ranks,
    )


def build_store(
    corpus: str | os.PathLike,
    out: str | os.PathLike,
    *,
    column: str = "input_ids",
    labels_column: str = "labels",
    tokenizer: str | os.PathLike | None = None,
    chat: bool = False,
    text_column: str = "text",
    messages_column: str = "messages",
    eos: bool = True,
    chat_template: str | os.PathLike | None = None,
    train_on: str = "assistant",
    num_proc: int | None = None,
    pairs: bool = False,
    prompt_column: str = "prompt",
    chosen_column: str = "chosen",
    rejected_column: str = "rejected",
    groups: bool = False,
    completions_column: str = "completions",
    scores_column: str | None = None,
    ranks_column: str | None = None,
    unpaired: bool = False,
    completion_column: str = "completion",
    label_column: str = "label",
    kl_seed: int = 0,
    shard_size: int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    append: bool = False,
    engine: str = "local",
    ray_address: str | None = None,
    progress: bool = False,
    console: Console | None = None,
) -> StoreManifest:
    """Read (and tokenize) a corpus once into a document store under `out`, and return the store
    manifest written there. Every build of the store (`build(out, ...)`) is then byte for byte the
    build of the corpus with these reading options, without reading or tokenizing the corpus again.

    >>> build_store("chats.jsonl", "store/", tokenizer="./tok", chat=True)   # doctest: +SKIP
    >>> build("store/", "packed-8k/", max_len=8192)                           # doctest: +SKIP

    The reading and tokenizing options (`column` to `num_proc`) are `build`'s; `shard_size` bounds the
    bytes of tokens (and labels) per shard. `engine` and `ray_address` as for `build`: with "ray", the
    store is written by Ray tasks, byte for byte as the local engine writes it. With `append`, the corpus's
    documents are added to the store at `out` (read and tokenized as the store records: other options are
    refused by name), in new shards after its own, which stay byte for byte as they are; the store's
    `generations` record which documents each append added, so that index builds of an earlier generation
    keep reading it (`prepack.formats.store.StoreManifest.at_generation`). With `pairs` or `groups`, the store
    holds each pair's (group's) documents as a pair build reads them, in shards of whole groups, and records how
    they were read (`StoreManifest.pairs`): its builds are those of the corpus with `pairs` (`groups`). Raises `InputError` for
    bad input (a store given as the corpus among it), and `OutputError` as `build` does; in every case
    nothing is published.
    """
    keywords = locals()
    return build_document_store(corpus, out, _gathered(Reading, keywords), _gathered(Output, keywords))


def build_document_store(corpus: str | os.PathLike, out: str | os.PathLike, reading: Reading, output: Output) -> StoreManifest:
    """`build_store`, with its options gathered (what `prepack tokenize` parses its flags into)."""
    if reading.unpaired:  # each example's KL completion is planned over the whole corpus, at build time
        raise InputError("a document store holds documents, pairs or groups, not unpaired examples: build them from the corpus (prepack build CORPUS --unpaired ...).")
    if given := [flag for flag, column in (("--scores-column", reading.scores_column), ("--ranks-column", reading.ranks_column))
                 if column is not None]:  # a store's shards hold tokens and labels, with no column for them
        raise InputError(f"a document store holds the groups' documents, not their scores or ranks: leave out {' and '.join(given)}, "
                         "or build with them from the corpus (prepack build CORPUS --groups ...).")
    if output.shard_size < 1:
        raise InputError(f"invalid shard size {output.shard_size}: at least 1 byte.")
    _check_engine(output.engine, output.ray_address, reading)
    _check_append(output)
    with progress_bars(output.progress, output.console) as bar, local_input(corpus) as source:
        if is_store(source.spec):
            raise InputError(f"{corpus} is a document store already: build from it (prepack build {corpus} ...).")
        documents = open_documents(source.spec, reading, out, bar, source.location)
        with (
            _staged(out, output, STORE_MANIFEST_NAME) as staging,
            _engine(output.engine, output.ray_address, staging) as engine_steps,
        ):
            if (appending := staging.appending) is not None:
                _check_same_reading(documents, appending, out)
            written = engine_steps.write_store(documents, reading, output.shard_size, bar)
            # Only a store that records no length_counts (one never appended to) has its lengths read.
            stored = None if appending is None or appending.length_counts else _stored_lengths(staging, appending)
            return finish_store(documents, staging.build, written, appending, stored)


def _staged(out: str | os.PathLike, output: Output, kind: str = MANIFEST_NAME):
    """Where a build or store is written (`kind`): staged beside a local `out`, or for a prefix in object
    storage; with `output.append`, grown from the one there (`staged_append`, `staged_prefix`)."""
    if is_uri(out):
        return staged_prefix(str(out), output.overwrite, kind, append=output.append)
    return staged_append(out, kind) if output.append else staged_directory(out, output.overwrite, kind)


def _check_append(output: Output) -> None:
    """Refuse, before anything is read, what an append cannot honour."""
    if not output.append:
        return
    if output.overwrite:
        raise InputError("--append grows the output at --out and --overwrite replaces it: give one of them.")


def _check_same_reading(documents: Documents, store: StoreManifest, out: str | os.PathLike) -> None:
    """Refuse (InputError, naming the first option that differs) documents read otherwise than those of
    the store at `out`, which an append adds them to."""
    def options(column: str, labels_column: str | None, has_labels: bool, tokenize: TokenizeOptions | None, pairs: PairOptions | None) -> dict:
        # The tokenizer's name is informative (shard-format.md): the same files under another name read alike.
        how = None if tokenize is None else tokenize.model_dump(exclude={"tokenizer": {"name"}})
        # Pairs first: a pair corpus and a text one differ in their column too, but their kind is the cause.
        kind = None if pairs is None else pairs.model_dump()
        return {"pairs": kind, "column": column, "labels_column": labels_column, "has_labels": has_labels, "tokenize": how}

    read = options(documents.column, documents.labels_column, documents.has_labels, documents.tokenize,
                   None if documents.pairs is None else documents.pairs.options)
    stored = options(store.column, store.labels_column, store.has_labels, store.tokenize, store.pairs)
    if (difference := _first_difference(stored, read)) is not None:
        name, was, now = difference
        raise InputError(
            f"{out} was read with {name} {was!r}, and this corpus is read with {now!r}: an append reads its "
            "documents as the store's were read (give the same --tokenizer, --chat, --chat-template, --train-on, "
            "--eos, --pairs or --groups and columns)."
        )
    named = {f.path for f in store.inputs}
    if taken := [name for path in documents.corpus.files if (name := documents.corpus.name(path)) in named]:
        raise InputError(
            f"{documents.corpus.root}: the store at {out} holds a corpus file named {taken[0]!r} already, and it names "
            "each document's file by that name (its provenance): rename this batch's files, such as week-48.parquet."
        )


def _first_difference(was: dict, now: dict, prefix: str = "") -> tuple[str, object, object] | None:
    """(dotted name, value in `was`, value in `now`) of the first field of two nested dicts that differs."""
    for key in was:
        if isinstance(was[key], dict) and isinstance(now[key], dict):
            if (found := _first_difference(was[key], now[key], f"{prefix}{key}.")) is not None:
                return found
        elif was[key] != now[key]:
            return f"{prefix}{key}", was[key], now[key]
    return None


def _stored_lengths(staging: Staging, store: StoreManifest) -> np.ndarray:
    """The lengths of the documents of the store being appended to, from its shards' offsets (no token
    read): those staged beside the new ones, or, in object storage, downloaded into scratch."""
    root = staging.build
    if staging.publication is not None:
        root = staging.scratch
        for shard in store.shards:
            fetch(staging.publication.shard_uri(shard.name), root / shard.name)
    stored = Store(root, store)
    return np.concatenate([stored.shard_document_lengths(shard) for shard in store.shards])
