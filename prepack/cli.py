"""The `prepack` command: a thin layer over the library; every PrepackError becomes a message and
exit code 2.

Each command imports the library where it runs, so that `prepack --help` (and a command's help)
imports neither numpy, pyarrow, numba nor pydantic: `python benchmarks/bench_startup.py` times it."""

from __future__ import annotations

import functools
import json
import inspect
import signal
import threading
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
import typer.core

from prepack.errors import InputError, PrepackError, UsageError, require

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from prepack.building.build import Output
    from prepack.sources.documents import Reading
    from prepack.formats.shards import Manifest

_NO_BREAK = "\u2011"  # a non-breaking hyphen, which textwrap leaves whole


class _HelpFormatter(typer.Context.formatter_class):
    """click's help formatter, wrapping lines at spaces only: textwrap also breaks them after a hyphen,
    which would cut "--messages-column" or "prepack-llm[s3]" in two."""

    def write_text(self, text: str) -> None:
        super().write_text(text.replace("-", _NO_BREAK))

    def write_dl(self, rows, *args, **kwargs) -> None:
        super().write_dl([(term, text.replace("-", _NO_BREAK)) for term, text in rows], *args, **kwargs)

    def getvalue(self) -> str:
        return super().getvalue().replace(_NO_BREAK, "-")


class _Context(typer.Context):
    formatter_class = _HelpFormatter


class _Group(typer.core.TyperGroup):
    context_class = _Context


class _Command(typer.core.TyperCommand):
    context_class = _Context


# Help is click's plain text, wrapped at the terminal's width: rich's would read the brackets of
# "prepack-llm[s3]" as markup and drop them, cut option names short at 80 columns and give flags a <bool>.
app = typer.Typer(
    cls=_Group,
    add_completion=False,
    rich_markup_mode=None,
    no_args_is_help=True,
    help="Pack documents into fixed-length rows once, offline.",
)


@functools.cache
def _stderr() -> Console:
    """The console of progress bars and errors; rich is imported when one is shown, not for --help."""
    from rich.console import Console

    return Console(stderr=True)


def _stdout() -> Console:
    from rich.console import Console

    return Console()


@app.callback()
def _commands(context: typer.Context) -> None:
    """Pack documents into fixed-length rows once, offline."""
    if threading.current_thread() is threading.main_thread():  # where Python lets a handler be set
        context.call_on_close(_SigtermStop().close)


class _SigtermStop:
    """SIGTERM (`kill`, `timeout`, a job scheduler) ends a command as an error does: its `finally` blocks
    delete its staging directory and temporary files, stop its worker processes and shut down a Ray
    instance it started; then it exits 143 (128 + 15, as a shell reports it). Set by the command line
    alone, for the command's run: a library call leaves its caller's signal handlers as they are."""

    def __init__(self) -> None:
        self.received = False
        self.previous = signal.signal(signal.SIGTERM, self._stop)

    def _stop(self, signum: int, frame: object) -> None:
        self.received = True
        signal.signal(signal.SIGTERM, lambda *_: None)  # a second SIGTERM does not cut that cleanup short
        _stderr().print("[bold red]error:[/] stopped by SIGTERM; its output is cleaned up as after any error.", markup=True, highlight=False)
        raise SystemExit(128 + signum)

    def close(self) -> None:
        """When the command has ended: the handler it replaced, and exit 143 if stopped, whatever the
        SystemExit became on its way out (`ray.get` turns one raised while it waits into exit code 1)."""
        signal.signal(signal.SIGTERM, self.previous)
        if self.received:
            raise SystemExit(128 + signal.SIGTERM)


def _choices(name: str, values: tuple[str, ...]) -> type[Enum]:
    """A flag's choices as typer takes them: a str Enum whose members are named as their values."""
    return Enum(name, {value: value for value in values}, type=str)


Algorithm = _choices("Algorithm", ("ffd", "bfd"))
TrainOn = _choices("TrainOn", ("assistant", "all"))
Engine = _choices("Engine", ("local", "ray"))
Overflow = _choices("Overflow", ("split", "truncate", "drop", "error"))


# Reading and tokenizing options, shared by `build` and `tokenize` (`_with_reading_options`): each
# declared here once, with its default, under the name of its `prepack.sources.documents.Reading` field.
_READING_OPTIONS: dict[str, tuple[object, object]] = {
    "column": (Annotated[str, typer.Option(help="Token column.")], "input_ids"),
    "labels_column": (Annotated[str, typer.Option("--labels-column", help="Labels column, carried when present.")], "labels"),
    "tokenizer": (Annotated[Path | None, typer.Option(help="Tokenize text or chat with this local tokenizer directory or tokenizer.json.")], None),
    "chat": (Annotated[bool, typer.Option("--chat", help="The corpus holds conversations (--messages-column), rendered with the chat template.")], False),
    "text_column": (Annotated[str, typer.Option("--text-column", help="Text column.")], "text"),
    "messages_column": (Annotated[str, typer.Option("--messages-column", help="Messages column (--chat).")], "messages"),
    "chat_template": (Annotated[Path | None, typer.Option("--chat-template", help="A Jinja chat template file instead of the tokenizer's.")], None),
    "train_on": (Annotated[TrainOn, typer.Option("--train-on", help="--chat: which tokens keep their labels.")], TrainOn.assistant),
    "eos": (Annotated[bool, typer.Option("--eos/--no-eos", help="Append EOS to every text document.")], True),
    "num_proc": (Annotated[int | None, typer.Option("--num-proc", min=1, help="Tokenizer threads (text) or processes (chat); default: all cores.")], None),
    "pairs": (Annotated[bool, typer.Option("--pairs", help="The corpus holds preference pairs (prompt, chosen, rejected; text, or conversations with --chat), each pair packed whole; needs --tokenizer and --overflow truncate, drop or error.")], False),
    "prompt_column": (Annotated[str, typer.Option("--prompt-column", help="--pairs: the prompt column; a row without one takes the common prefix of chosen and rejected as its prompt.")], "prompt"),
    "chosen_column": (Annotated[str, typer.Option("--chosen-column", help="--pairs: the chosen completion column.")], "chosen"),
    "rejected_column": (Annotated[str, typer.Option("--rejected-column", help="--pairs: the rejected completion column.")], "rejected"),
    "groups": (Annotated[bool, typer.Option("--groups", help="The corpus holds groups: a prompt (--prompt-column) and a list of G completions (--completions-column; G its first row's, every row's), each group packed whole as G documents; needs --tokenizer and --overflow truncate, drop or error.")], False),
    "completions_column": (Annotated[str, typer.Option("--completions-column", help="--groups: the column of completions, a list a row.")], "completions"),
    "scores_column": (Annotated[str | None, typer.Option("--scores-column", help="--groups: a column of G scores a row (finite numbers, one a completion), stored beside each completion and collated as group_scores.")], None),
    "ranks_column": (Annotated[str | None, typer.Option("--ranks-column", help="--groups: a column of G ranks a row (integers, 1 the best; ties share a rank, as 1, 2, 2, 4), stored beside each completion and collated as group_ranks.")], None),
    "unpaired": (Annotated[bool, typer.Option("--unpaired", help="The corpus holds unpaired feedback for KTO (TRL's format: a prompt, a completion and a boolean label a row), each example packed whole with its KL completion, another example's completion planned from --kl-seed; needs --tokenizer and --overflow truncate, drop or error.")], False),
    "completion_column": (Annotated[str, typer.Option("--completion-column", help="--unpaired: the completion column.")], "completion"),
    "label_column": (Annotated[str, typer.Option("--label-column", help="--unpaired: the label column, true for a desirable completion.")], "label"),
    "kl_seed": (Annotated[int, typer.Option("--kl-seed", min=0, help="--unpaired: seed of the plan of KL completions (one seeded cycle through the examples).")], 0),
}


def _with_reading_options(command: Callable[..., None]) -> Callable[..., None]:
    """`command` taking the reading options (`_READING_OPTIONS`) in place of its parameter `reading`,
    which gets them as one `prepack.sources.documents.Reading`."""
    # `Reading` is imported for type checkers only (prepack.sources.documents imports pyarrow, which a command's
    # help must not): here, where the annotations are read, the name stands for nothing.
    signature = inspect.signature(command, eval_str=True, locals={"Reading": None})
    parameters: list[inspect.Parameter] = []
    for parameter in signature.parameters.values():
        if parameter.name != "reading":
            parameters.append(parameter)
            continue
        for name, (annotation, default) in _READING_OPTIONS.items():
            parameters.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default))

    @functools.wraps(command)
    def with_reading(**values: object) -> None:
        from prepack.sources.documents import Reading

        options = {name: values.pop(name) for name in _READING_OPTIONS}
        options["train_on"] = options["train_on"].value
        command(**values, reading=Reading(**options))

    with_reading.__signature__ = signature.replace(parameters=parameters)  # what typer reads the options from
    with_reading.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
    return with_reading


# prepack.building.build.DEFAULT_SHARD_SIZE, spelled out (a test keeps them equal): importing prepack.build would
# import numpy, pyarrow and numba for every command's help.
_DEFAULT_SHARD_SIZE = "64MiB"
_ShardSizeOption = Annotated[str, typer.Option(help="Target shard size, e.g. 64MiB or 1GB.")]
_QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or summary.")]
_EngineOption = Annotated[Engine, typer.Option("--engine", help="Where reading, tokenizing and shard writing run: here, or as Ray tasks across a cluster (needs prepack-llm[ray]); the output is the same.")]
_RayAddressOption = Annotated[str | None, typer.Option("--ray-address", help="--engine ray: join this cluster ('auto', 'ray://HOST:PORT'); default: RAY_ADDRESS if set, else a new local Ray instance.")]
_BuildArgument = Annotated[str, typer.Argument(help="A build directory (holding manifest.json), or a URI such as s3://bucket/packed (needs prepack-llm[s3]).")]
# A str, not a Path: typer would make "" Path("."); the library refuses an empty name (`cache_directory`).
_CacheDirOption = Annotated[str | None, typer.Option("--cache-dir", help="For a build at a URI: where its shards are downloaded (default: a temporary directory, deleted after).")]


def _byte_size(text: str) -> int:
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise typer.BadParameter(f"{text!r} is not a size such as 256MiB or 1GB") from None


def _integers(flag: str, text: str) -> list[int]:
    """A comma-separated list of integers given to `flag`; anything else is an InputError."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise InputError(f"{flag} {text!r}: give comma-separated integers, such as 8,16,32.") from None


def _fail(exc: PrepackError) -> None:
    # Escaped: messages quote paths, values and commands such as "pip install 'prepack-llm[train]'", whose
    # brackets rich would otherwise take for markup and drop.
    from rich.markup import escape

    _stderr().print(f"[bold red]error:[/] {escape(str(exc))}", markup=True, highlight=False)
    raise typer.Exit(2)


def _summary(manifest: Manifest, out: str) -> Table:
    from rich.table import Table

    from prepack.formats.shards import unit_name

    t, o = manifest.totals, manifest.options
    table = Table(title=f"packed into {out}", show_header=False, title_justify="left")
    fill = t.tokens / (t.packs * o.max_len)
    over = t.packs - t.lower_bound
    rows = [
        ("documents", f"{t.documents:,}"),
        ("tokens", f"{t.tokens:,}"),
        ("packs", f"{t.packs:,} ({over:,} over the lower bound {t.lower_bound:,}, {over / t.lower_bound:+.3%})"),
        ("fill", f"{fill:.2%} ({t.padding_tokens:,} padding tokens)"),
        ("shards", f"{len(manifest.shards)}"),
        ("split / truncated / dropped / empty", f"{t.split:,} / {t.truncated:,} / {t.dropped:,} / {t.empty:,}"),
        ("labels", "in the shards" if manifest.has_labels else "none"),
        ("untrained (no trained token)", _untrained(t.untrained, t.untrained_tokens, o.drop_untrained)),
    ]
    units = unit_name(2 if o.pairs is None else o.pairs.size, plural=True)
    units = "examples" if o.unpaired else units
    if (p := manifest.pairs) is not None:
        labels = "" if p.desirable is None else f"; desirable / undesirable {p.desirable:,} / {p.undesirable:,}"
        rows.insert(1, (units, f"{p.pairs:,} read, {p.truncated:,} truncated, {p.dropped:,} dropped; "
                               f"prompt / completion tokens {p.prompt_tokens:,} / {p.completion_tokens:,}{labels}"))
    if o.tokenize is not None and o.pairs is not None:
        rows.insert(0, ("tokenized", f"{o.tokenize.tokenizer.name} ({o.tokenize.mode} {units.split()[0]}, labels on the completions)"))
    elif o.tokenize is not None:
        how = "chat, labels on " + o.tokenize.train_on if o.tokenize.mode == "chat" else "text" + (" + EOS" if o.tokenize.eos else "")
        rows.insert(0, ("tokenized", f"{o.tokenize.tokenizer.name} ({how}), column {o.tokenize.column!r}"))
    for source in manifest.mixture.sources if manifest.mixture is not None else []:
        rows.append((
            f"source {source.name}",
            f"{source.tokens:,} tokens ({source.weight_realized:.2%}, asked {source.requested_weight:.2%}), "
            f"{source.documents:,} documents ({source.full_epochs} epochs + {source.partial_documents:,})",
        ))
    for name, value in rows:
        table.add_row(name, value)
    return table


def _untrained(documents: int, tokens: int, dropped: bool) -> str:
    return f"{documents:,} ({tokens:,} tokens, {'left out' if dropped else 'packed; --drop-untrained leaves them out'})"


def _output(shard_size: str, overwrite: bool, engine: Engine, ray_address: str | None, quiet: bool, append: bool = False) -> Output:
    """How `build` and `tokenize` write what they write, from their flags."""
    from prepack.building.build import Output

    return Output(
        shard_size=_byte_size(shard_size),
        overwrite=overwrite,
        append=append,
        engine=engine.value,
        ray_address=ray_address,
        progress=not quiet,
        console=None if quiet else _stderr(),
    )


@app.command("build", cls=_Command)
@_with_reading_options
def build_command(
    corpus: Annotated[str | None, typer.Argument(show_default=False, help="A file, directory or glob: Parquet, JSONL(.gz/.zst), Arrow, or a save_to_disk directory; or a document store (prepack tokenize); or a mixture file (.yaml, .yml, .json). Local, or a URI such as s3://bucket/corpus/. Leave it out to mix the --source flags.")] = None,
    *,
    out: Annotated[str, typer.Option("--out", "-o", help="Output directory (created atomically), or a URI such as s3://bucket/packed (needs prepack-llm[s3]).")],
    max_len: Annotated[int, typer.Option("--max-len", help="Tokens per pack.")] = 8192,
    source: Annotated[list[str] | None, typer.Option("--source", metavar="NAME=PATH[:AMOUNT]", show_default=False, help="Instead of CORPUS, a mixture's source, once per source: a corpus or store (relative to here, or a URI) and AMOUNT, comma-separated weight=W (or W alone), epochs=E, max_epochs=N as in a mixture file; no AMOUNT: 1 epoch. E.g. --source web=web/:0.7,max_epochs=2 --source math=s3://b/math/:epochs=2.")] = None,
    tokens: Annotated[str | None, typer.Option("--tokens", metavar="N|all", show_default=False, help="With --source: the mixture's output tokens, or all (every source its epochs; the default).")] = None,
    mix_seed: Annotated[str | None, typer.Option("--mix-seed", metavar="N", show_default=False, help="With --source: seed of the mixture's document selection (default 0; --seed shuffles the packs).")] = None,
    pack_within_source: Annotated[bool, typer.Option("--pack-within-source", help="With --source: no pack holds documents of two sources.")] = False,
    mix_count: Annotated[str | None, typer.Option("--mix-count", metavar="tokens|trained", show_default=False, help="With --source: what --tokens, weights and epochs count: every token (default) or trained tokens (labels other than -100).")] = None,
    reading: Reading,
    algorithm: Annotated[Algorithm, typer.Option(help="First-fit or best-fit decreasing.")] = Algorithm.ffd,
    overflow: Annotated[Overflow, typer.Option(help="Documents longer than --max-len.")] = Overflow.split,
    seed: Annotated[int, typer.Option(help="Seed of the pack-order shuffle.")] = 0,
    drop_untrained: Annotated[bool, typer.Option("--drop-untrained", help="Leave out documents with no trained token (every label -100); they are counted either way.")] = False,
    index_only: Annotated[bool, typer.Option("--index-only", help="A document store only: write which documents each pack holds, no token; the build reads them from the store.")] = False,
    max_docs_per_pack: Annotated[int | None, typer.Option("--max-docs-per-pack", metavar="K", show_default=False, help="At most K documents a pack (a preference pair counts as two), planned exactly with --max-len: fixed-shape batches for torch.compile and CUDA graphs (README, \"Compiled training\"). `prepack inspect` shows what a cap costs.")] = None,
    max_images_per_pack: Annotated[int | None, typer.Option("--max-images-per-pack", metavar="M", show_default=False, help="At most M images a pack (a vision tower's memory follows its images), each row counting its images in --images; a row with more is refused by file and row.")] = None,
    images: Annotated[str | None, typer.Option("--images", metavar="DIR", show_default=False, help="With --max-images-per-pack: the image set prepare-images wrote with this corpus.")] = None,
    shard_size: _ShardSizeOption = _DEFAULT_SHARD_SIZE,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing build at --out.")] = False,
    append: Annotated[bool, typer.Option("--append", help="Grow the build at --out by the documents appended to its store since (same options as the build); its shards stay as they are (README, \"Growing a corpus\").")] = False,
    engine: _EngineOption = Engine.local,
    ray_address: _RayAddressOption = None,
    quiet: _QuietOption = False,
) -> None:
    """Pack a corpus into Arrow shards with a manifest: token ids as they are, or text and chat
    tokenized with --tokenizer. A mixture of several corpora or stores is given as a file (CORPUS)
    or as --source flags with --tokens, --mix-seed and --pack-within-source (README, "Mixtures")."""
    from prepack.building.build import Packing, build_packs
    from prepack.building.mixture import mixture_flags

    packing = Packing(
        max_len=max_len,
        algorithm=algorithm.value,
        overflow=overflow.value,
        seed=seed,
        drop_untrained=drop_untrained,
        index_only=index_only,
        max_docs_per_pack=max_docs_per_pack,
        max_images_per_pack=max_images_per_pack,
        images=images,
    )
    try:
        mixture = mixture_flags(corpus, source or [], tokens, mix_seed, pack_within_source, mix_count)
        manifest = build_packs(mixture or corpus, out, reading, packing, _output(shard_size, overwrite, engine, ray_address, quiet, append))
    except PrepackError as exc:
        _fail(exc)
    if not quiet:
        _stdout().print(_summary(manifest, out))


@app.command("tokenize", cls=_Command)
@_with_reading_options
def tokenize_command(
    corpus: Annotated[str, typer.Argument(help="A file, directory or glob: Parquet, JSONL(.gz/.zst), Arrow, or a save_to_disk directory.")],
    out: Annotated[str, typer.Option("--out", "-o", help="Store directory (created atomically), or a URI such as s3://bucket/store (needs prepack-llm[s3]).")],
    *,
    reading: Reading,
    shard_size: _ShardSizeOption = _DEFAULT_SHARD_SIZE,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing store at --out.")] = False,
    append: Annotated[bool, typer.Option("--append", help="Add the corpus's documents to the store at --out, read as the store records (same tokenizer and options); its shards stay as they are.")] = False,
    engine: _EngineOption = Engine.local,
    ray_address: _RayAddressOption = None,
    quiet: _QuietOption = False,
) -> None:
    """Read and tokenize a corpus once into a document store, which `prepack build STORE` packs at any
    --max-len, seed or algorithm without tokenizing again."""
    from prepack.building.build import build_document_store

    try:
        manifest = build_document_store(corpus, out, reading, _output(shard_size, overwrite, engine, ray_address, quiet, append))
    except PrepackError as exc:
        _fail(exc)
    if not quiet:
        lengths = manifest.lengths
        _stdout().print(
            f"stored {manifest.documents:,} documents, {manifest.tokens:,} tokens in {len(manifest.shards)} "
            f"shard{'s' * (len(manifest.shards) != 1)} under {out} (lengths {lengths.min:,}-{lengths.max:,}, median {lengths.p50:,}, p99 {lengths.p99:,})"
        )


@app.command("prepare-images", cls=_Command)
def prepare_images_command(
    corpus: Annotated[Path, typer.Argument(help="An image-chat (or image-text) corpus: .jsonl, .json (LlamaFactory's ShareGPT too), .parquet or Arrow files, or a save_to_disk folder.")],
    processor: Annotated[Path, typer.Option("--processor", help="A local processor directory: tokenizer.json with the image tokens, preprocessor_config.json.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="New directory: corpus.parquet to build, and images/ (the image set).")],
    max_image_bytes: Annotated[int | None, typer.Option("--max-image-bytes", min=1, help="Largest encoded image (default 32 MiB).")] = None,
    max_pixels: Annotated[int | None, typer.Option("--max-pixels", min=1, help="Largest width x height (default 32Mi pixels, VisionCollator's per-image limit too).")] = None,
    max_images: Annotated[int | None, typer.Option("--max-images", min=1, help="Most images in one record (default 64).")] = None,
    images_root: Annotated[Path | None, typer.Option("--images-root", help="The one directory images come from (default: each corpus file's own); paths must resolve inside it.")] = None,
) -> None:
    """Count every image's placeholder tokens from its header and the processor's resize rule, store the
    images once (sha256) beside the build, and write the corpus to build with --tokenizer (needs
    prepack-llm[images])."""
    from prepack.formats.images import ImageLimits
    from prepack.sources.images import prepare_image_chat

    given = {"max_image_bytes": max_image_bytes, "max_pixels": max_pixels, "max_images_per_document": max_images}
    try:
        try:
            limits = ImageLimits(**{name: value for name, value in given.items() if value is not None})
        except ValueError as exc:  # pydantic's bounds
            raise UsageError(f"A limit is out of range: {exc}") from None
        summary = prepare_image_chat(corpus, processor, out, limits=limits, images_root=images_root)
    except PrepackError as exc:
        _fail(exc)
    videos = f", {summary.videos:,} videos (their frames among the images)" if summary.videos else ""
    _stdout().print(
        f"prepared {summary.documents:,} records, {summary.references:,} images ({summary.images:,} distinct, "
        f"{summary.image_tokens:,} placeholder tokens){videos}: build {summary.corpus}, train with {summary.image_set}"
    )


@app.command("inspect", cls=_Command)
def inspect_command(
    path: _BuildArgument,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Batch size of the pad-to-longest baseline, and packs per rank per step with --world-size.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed of the baseline's random batches and of the sampler's order.")] = 0,
    world_size: Annotated[int | None, typer.Option("--world-size", min=1, help="Also report the ranks' imbalance per step, with and without PackedSampler(balance='attention').")] = None,
    token_cost: Annotated[float | None, typer.Option("--token-cost", min=0, help="Cost of a token in units of one attention token pair (default: prepack.building.balance.DEFAULT_TOKEN_COST, a 7-8B model; 0: attention alone).")] = None,
    shards: Annotated[bool, typer.Option("--shards", help="Add a per-shard table.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the numbers as JSON instead.")] = False,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="Also draw the distributions and costs, e.g. report.png (needs prepack-llm[plot]).")] = None,
    cache_dir: _CacheDirOption = None,
    images: Annotated[Path | None, typer.Option("--images", help="The image set prepared with its corpus: also report image and text tokens and the padding saved.")] = None,
    caps: Annotated[str | None, typer.Option("--caps", metavar="K,K,...", show_default=False, help="The --max-docs-per-pack values to price (packs and fill, planned again); default 2, 4, ..., 128 below the fullest pack.")] = None,
) -> None:
    """Report fill, padding, distributions and the cost of not packing, from the manifest and the
    per-pack columns (a preference-pair build's tokens and labels are read too, to count its pairs)."""

    from prepack.check.report import inspect_build, plot, render

    try:
        costs = {} if token_cost is None else {"token_cost": token_cost}
        if caps is not None:
            costs["caps"] = _integers("--caps", caps)
        report = inspect_build(path, batch_size=batch_size, seed=seed, world_size=world_size, cache_dir=cache_dir, **costs)
        if plot_path is not None:
            plot(report, plot_path)
        image_lines = None
        if images is not None:
            from prepack.check.images import image_report

            image_lines = image_report(path, images, report)
        text = report.to_json() if as_json else None
        if text is not None and image_lines is not None:  # the build's report, and the image lines beside it
            text = json.dumps({"build": json.loads(text), "images": image_lines.model_dump(mode="json")}, indent=2)
    except PrepackError as exc:
        _fail(exc)
    if text is not None:
        typer.echo(text)
    else:
        _stdout().print(render(report, shards=shards))
        if image_lines is not None:
            for name, value in image_lines.model_dump().items():
                typer.echo(f"{name.replace('_', ' ')}: {value:,.3f}" if isinstance(value, float) else f"{name.replace('_', ' ')}: {value:,}")
    if plot_path is not None:  # after the report; beside --json on stderr, which keeps stdout JSON
        typer.echo(f"plot written to {plot_path}", err=as_json)


@app.command("verify", cls=_Command)
def verify_command(
    path: Annotated[str, typer.Argument(help="A build directory (holding manifest.json) or document store (store.json), or a URI such as s3://bucket/packed (needs prepack-llm[s3]).")],
    source: Annotated[str | None, typer.Option("--source", help="The corpus it was built from, or a store of it: check every token.")] = None,
    tokenizer: Annotated[Path | None, typer.Option(help="With --source, for a build that tokenized text or chat: its tokenizer.")] = None,
    chat_template: Annotated[Path | None, typer.Option("--chat-template", help="With --source: the chat template file the build was given, if any.")] = None,
    all_problems: Annotated[bool, typer.Option("--all", help="Report every problem, not only the first.")] = False,
    cache_dir: _CacheDirOption = None,
    store: Annotated[Path | None, typer.Option("--store", help="An index build's store, where it lies now if it moved (a local directory).")] = None,
    images: Annotated[Path | None, typer.Option("--images", help="The image set prepared with its corpus: check it, and every pack's image tokens.")] = None,
    decode: Annotated[bool, typer.Option("--decode", help="With --images: also decode every image, as training will (slower).")] = False,
    reference: Annotated[Path | None, typer.Option("--reference", help="A pair build's stored reference log-probabilities: check them against their manifest and the build.")] = None,
    export: Annotated[Path | None, typer.Option("--export", help="An export of this build (prepack export): check that its files are intact and the build is still the one it was written from.")] = None,
) -> None:
    """Check shards against the manifest and the format (and every token against --source); a document
    store on its own: its shards against store.json, its documents against their fingerprints and counts.
    Exit 0: sound; 1: problems found (printed); 2: not a build or store, or an unreadable --source."""
    from prepack.check.verify import checked_summary, holds_store, verify_build, verify_store_with_summary

    store_summary = None  # a store's, checked on its own: the options below, a build's, were refused with it
    try:
        if holds_store(path):
            build_options = {"--source": source, "--tokenizer": tokenizer, "--chat-template": chat_template, "--cache-dir": cache_dir,
                             "--store": store, "--images": images, "--decode": decode or None, "--reference": reference, "--export": export}
            if (given := next((name for name, value in build_options.items() if value is not None), None)) is not None:
                raise InputError(f"{path} is a document store, verified on its own: {given} applies to a build only.")
            problems, store_summary = verify_store_with_summary(path, all_problems=all_problems)
        else:
            problems = verify_build(
                path, source, tokenizer=tokenizer, chat_template=chat_template, all_problems=all_problems,
                cache_dir=cache_dir, store=store,
            )
        if decode and images is None:
            raise UsageError("--decode decodes the images of an image set: give it with --images.")
        if images is not None:
            from prepack.check.images import verify_images

            problems = [*problems, *verify_images(path, images, decode=decode)]
            if not problems:
                from prepack.check.images import images_checked

                images_line = images_checked(path, images, decode=decode)
        if reference is not None:
            from prepack.check.reference import verify_reference

            problems = [*problems, *verify_reference(path, reference)]
        if export is not None:
            from prepack.exports import verify_export

            problems = [*problems, *verify_export(export, path, check_build=False)]  # verify_build checked the build
    except PrepackError as exc:
        _fail(exc)
    _report_problems(problems)
    if store_summary is not None:
        typer.echo(store_summary)
        return
    checked = f" {reference}: the reference log-probabilities checked." if reference is not None else ""
    if images is not None:
        checked += " " + images_line
    if export is not None:
        checked += f" {export}: the export's files and build checked."
    typer.echo(checked_summary(path, source) + checked)


def _report_problems(problems: list) -> None:
    """Print verify's findings, one `problem:` line each, and exit 1 when there is one."""
    for problem in problems:
        typer.echo(f"problem: {problem}")
    if problems:
        raise typer.Exit(1)


@app.command("export", cls=_Command)
def export_command(
    path: Annotated[str, typer.Argument(help="A local build directory (holding manifest.json): full, index or mixture.")],
    to: Annotated[str, typer.Option("--to", help="The format: parquet (with a Hugging Face dataset card), lance, megatron (indexed dataset and Megatron-Bridge packed Parquet) or olmo-core (token, label-mask and document files); an unknown name is refused with the list.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="A new directory (created atomically; an existing one is never replaced).")],
    quiet: _QuietOption = False,
) -> None:
    """Write a build in a format another training stack reads as its own, with export.json recording the
    build it came from (`prepack verify BUILD --export DIR` checks it later)."""
    from prepack.exports import export_build

    try:
        result = export_build(path, to, out)
    except PrepackError as exc:
        _fail(exc)
    if not quiet:
        size = sum(file.bytes for file in result.manifest.files)
        typer.echo(f"exported {result.manifest.build.packs:,} packs of {path} as {to} into {out} "
                   f"({len(result.manifest.files)} files, {size:,} bytes)")


# prepack.model.packing.SUPPORTED_ATTENTION, spelled out: importing it would import torch for every command.
Attention = _choices(
    "Attention",
    ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention"),
)
Dtype = _choices("Dtype", ("float32", "float64", "bfloat16", "float16"))


@app.command("reference-logps", cls=_Command)
def reference_logps_command(
    path: Annotated[Path, typer.Argument(help="A preference-pair build directory (prepack build --pairs).")],
    model: Annotated[Path, typer.Option("--model", help="The frozen reference: a local model directory (config.json and weights). Nothing is downloaded.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Where the values go: a new directory, which appears when every value is computed (a stopped run is taken up by the next run to it).")],
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Packs per forward.")] = 8,
    attn: Annotated[Attention, typer.Option("--attn", metavar="IMPLEMENTATION", help="Attention implementation, as check-isolation takes it.")] = Attention.sdpa,
    dtype: Annotated[Dtype | None, typer.Option("--dtype", help="Model dtype.", show_default="the checkpoint's")] = None,
    device: Annotated[str | None, typer.Option("--device", help="Torch device, e.g. cpu or cuda:1.", show_default="cuda if there is one, else cpu")] = None,
    quiet: _QuietOption = False,
) -> None:
    """Run a frozen reference model once over a pair build and store every document's summed completion
    log-probability, so that DPO needs no reference model while training (resumable: run it again after a
    stop; needs prepack-llm[train])."""
    try:
        require("transformers", "prepack reference-logps")
        torch = require("torch", "prepack reference-logps")
        from prepack.model.loading import load_local_model, torch_device
        from prepack.model.packing import enable_packing
        from prepack.training.reference import write_reference_logps

        shown = not quiet and _stderr().is_terminal  # progress on a terminal only: piped, rich prints the final bar
        loaded = load_local_model(model, attn.value, getattr(torch, dtype.value) if dtype else None, torch_device(device),
                                  progress=shown)
        reference = write_reference_logps(path, enable_packing(loaded).eval(), out, batch_size=batch_size, name=model.name,
                                          progress=shown, console=_stderr())
    except PrepackError as exc:
        _fail(exc)
    if not quiet:
        rows = sum(file.rows for file in reference.files)
        _stdout().print(f"stored the reference log-probabilities of {rows:,} packs ({len(reference.files)} files) of {model.name} under {out}")


@app.command("check-isolation", cls=_Command)
def check_isolation_command(
    model: Annotated[Path | None, typer.Option("--model", help="A local model directory (config.json and weights), or a config.json alone: random weights. Nothing is downloaded.")] = None,
    attn: Annotated[Attention, typer.Option("--attn", metavar="IMPLEMENTATION", help="Attention implementation: sdpa, eager, flash_attention_2, flash_attention_3, flash_attention_4 or flex_attention; the flash ones need a CUDA device and flash-attn (-3, -4).")] = Attention.sdpa,
    sweep: Annotated[bool, typer.Option("--sweep", help="Instead of --model: a tiny random model of every causal LM family the installed transformers registers, compared with prepack's table (on sdpa and eager also every image-text-to-text family, with packed images).")] = False,
    dtype: Annotated[Dtype | None, typer.Option("--dtype", help="Model dtype.", show_default="float64 on cpu, float32 on cuda, bfloat16 on flash")] = None,
    device: Annotated[str | None, typer.Option("--device", help="Torch device, e.g. cpu or cuda:1.", show_default="cuda if there is one, else cpu")] = None,
    packs: Annotated[int, typer.Option("--packs", min=1, help="Random packs in the batch, 1-4 documents each.")] = 2,
    max_len: Annotated[int, typer.Option("--max-len", min=1, help="Tokens per pack.")] = 256,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the documents (and of random weights).")] = 0,
    tolerance: Annotated[float | None, typer.Option("--tolerance", min=0, help="Largest difference allowed.", show_default="per dtype: 1e-6 for float64 (5e-6 on eager), 1e-4 for float32")] = None,
    gradients: Annotated[bool, typer.Option("--gradients/--no-gradients", help="Compare parameter gradients too (a backward pass per document).")] = True,
) -> None:
    """Run random packed documents through a local model with enable_packing, and each document alone,
    and print the largest differences. Exit 0: isolated; 1: documents leak into each other; 2: bad input,
    a family prepack refuses on this backend (the reason is printed), or a model that fails on the batch.
    With --sweep: one line per family; exit 0 when every family gives the table's verdict, 1 otherwise."""
    try:  # here, not at the top: torch and transformers take seconds to import
        transformers = require("transformers", "prepack check-isolation")
        check_isolation = require("prepack.model.isolation", "prepack check-isolation").check_isolation
        from prepack.model import families
    except PrepackError as exc:
        _fail(exc)
    if transformers.__version__ != families.MEASURED_VERSION:
        typer.echo(
            f"transformers {transformers.__version__}: prepack's table of families was measured on "
            f"{families.MEASURED_WITH}; on this release a family may differ ({families.SWEEP_COMMAND} re-measures)."
        )
    if sweep == (model is not None):
        _fail(PrepackError("check-isolation takes --model DIR or --sweep (every family), one of the two."))
    if sweep:
        _sweep(attn.value, device)
        return
    try:
        result = check_isolation(
            model,
            attn.value,
            dtype=dtype.value if dtype else None,
            device=device,
            packs=packs,
            max_len=max_len,
            seed=seed,
            tolerance=tolerance,
            gradients=gradients,
        )
    except PrepackError as exc:
        _fail(exc)
    weights = f"random weights from {model}" if model.is_file() else f"weights from {model}"
    typer.echo(f"transformers {transformers.__version__}, {result.model_class} ({weights})")
    typer.echo(f"attention {result.attn_implementation}, {result.dtype} on {result.device}")
    typer.echo(f"documents compared           {result.documents}, in {packs} packs of up to {max_len} tokens")
    measured = [
        ("largest logit difference", result.max_logit_diff, result.tolerance),
        ("loss difference", result.loss_diff, result.loss_tolerance),
    ]
    if result.max_grad_diff is not None:
        measured.append(("largest gradient difference", result.max_grad_diff, result.loss_tolerance))
    for name, value, allowed in measured:
        typer.echo(f"{name:<29}{value:.1e}  (tolerance {allowed:g})")
    if result.passed:
        typer.echo("isolated: every packed document matches the document run alone.")
        return
    over = ", ".join(name for name, value, allowed in measured if not value <= allowed)  # `not <=` catches NaN
    typer.echo(f"LEAK: packed documents differ from the documents alone ({over} over the tolerance).")
    raise typer.Exit(1)


def _sweep(attn: str, device: str | None) -> None:
    from prepack.model.isolation import sweep

    differ = []
    for check in sweep(attn, device=device):
        mark = "" if check.agrees else "  DIFFERS"
        typer.echo(f"{check.model_type:<28}table: {check.table:<34}measured: {check.measured[:100]}{mark}")
        if not check.agrees:
            differ.append(check.model_type)
    if attn in ("sdpa", "eager"):  # the vision sweep's backends on a CPU (prepack.model.vision_sweep)
        from prepack.model.vision_sweep import sweep as vision_sweep

        for image_check in vision_sweep(attn):
            mark = "" if image_check.agrees else "  DIFFERS"
            table, measured = _verdict_text(image_check.table), _verdict_text(image_check.measured, reason=True)
            typer.echo(f"{image_check.model_type + ' (images)':<28}table: {table:<34}measured: {measured[:100]}{mark}")
            if not image_check.agrees:
                differ.append(f"{image_check.model_type} (images)")
    if differ:
        typer.echo(f"{len(differ)} families differ from prepack's table on {attn}: {', '.join(differ)}.")
        raise typer.Exit(1)
    typer.echo(f"every family gives prepack's table's verdict on {attn}.")


def _verdict_text(found, reason: bool = False) -> str:
    if found is None:
        return "not measured on this version"
    return f"isolated ({found.label})" if found.isolated else f"refused: {found.reason}" if reason else "refused"
