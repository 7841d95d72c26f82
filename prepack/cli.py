"""The `prepack` command: a thin layer over the library; every PrepackError becomes a message and
exit code 2."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ByteSize, TypeAdapter, ValidationError
from rich.console import Console
from rich.table import Table

from prepack.build import DEFAULT_SHARD_SIZE, build
from prepack.errors import PrepackError
from prepack.format import Manifest

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Pack tokenized documents into fixed-length rows once, offline.",
)
console = Console(stderr=True)


@app.callback()
def _commands() -> None:
    """Pack tokenized documents into fixed-length rows once, offline."""


class Algorithm(str, Enum):
    ffd = "ffd"
    bfd = "bfd"


class Overflow(str, Enum):
    split = "split"
    truncate = "truncate"
    drop = "drop"
    error = "error"


def _byte_size(text: str) -> int:
    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise typer.BadParameter(f"{text!r} is not a size such as 256MiB or 1GB") from None


def _fail(exc: PrepackError) -> None:
    console.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False)
    raise typer.Exit(2)


def _summary(manifest: Manifest, out: Path) -> Table:
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
        ("labels", "carried" if manifest.has_labels else "none"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


@app.command("build")
def build_command(
    corpus: Annotated[str, typer.Argument(help="A file, directory or glob: Parquet, JSONL(.gz/.zst), Arrow, or a save_to_disk directory.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory (created atomically).")],
    max_len: Annotated[int, typer.Option("--max-len", help="Tokens per pack.")] = 8192,
    column: Annotated[str, typer.Option(help="Token column.")] = "input_ids",
    labels_column: Annotated[str, typer.Option("--labels-column", help="Labels column, carried when present.")] = "labels",
    algorithm: Annotated[Algorithm, typer.Option(help="First-fit or best-fit decreasing.")] = Algorithm.ffd,
    overflow: Annotated[Overflow, typer.Option(help="Documents longer than --max-len.")] = Overflow.split,
    seed: Annotated[int, typer.Option(help="Seed of the pack-order shuffle.")] = 0,
    shard_size: Annotated[str, typer.Option(help="Target shard size, e.g. 256MiB.")] = f"{DEFAULT_SHARD_SIZE // 2**20}MiB",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing build at --out.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or summary.")] = False,
) -> None:
    """Pack a tokenized corpus into Arrow shards with a manifest."""
    try:
        manifest = build(
            corpus,
            out,
            max_len=max_len,
            column=column,
            labels_column=labels_column,
            algorithm=algorithm.value,
            overflow=overflow.value,
            seed=seed,
            shard_size=_byte_size(shard_size),
            overwrite=overwrite,
            progress=not quiet,
            console=console,
        )
    except PrepackError as exc:
        _fail(exc)
    if not quiet:
        Console().print(_summary(manifest, out))
