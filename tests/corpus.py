"""Test corpora: write documents in every supported format, read a build back independently of
prepack's own reader (plain pyarrow, row by row), place documents with a textbook packer, and edit a
build's or a store's files by hand the way the damage tests do."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard


def corpus_table(documents: list[list[int]], labels: list[list[int]] | None = None) -> pa.Table:
    columns = {"input_ids": pa.array(documents, pa.list_(pa.int64()))}
    if labels is not None:
        columns["labels"] = pa.array(labels, pa.list_(pa.int64()))
    columns["text"] = pa.array([f"doc {i}" for i in range(len(documents))])  # a column prepack ignores
    return pa.table(columns)


def write_corpus(path: Path, table: pa.Table) -> Path:
    """Write `table` in the format the file name asks for."""
    name = path.name
    if name.endswith(".parquet"):
        pq.write_table(table, path)
    elif name.endswith(".arrow"):  # the random-access file format
        with pa.ipc.new_file(path, table.schema) as writer:
            writer.write_table(table)
    elif name.endswith(".ipc"):  # the stream format
        with pa.ipc.new_stream(path, table.schema) as writer:
            writer.write_table(table)
    elif ".jsonl" in name:
        text = "".join(json.dumps(row) + "\n" for row in table.to_pylist()).encode()
        if name.endswith(".gz"):
            text = gzip.compress(text, mtime=0)
        elif name.endswith(".zst"):
            text = zstandard.ZstdCompressor().compress(text)
        path.write_bytes(text)
    else:
        raise ValueError(name)
    return path


def random_token_corpus(path: Path, documents: int, seed: int = 0) -> Path:
    """A Parquet file of `documents` rows of 1-199 random token ids, written without Python lists, for
    builds that must run for seconds."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(1, 200, documents))]).astype(np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 1000, offsets[-1], dtype=np.int32)))
    pq.write_table(pa.table({"input_ids": ids}), path)
    return path

def training_build(root: Path, *, documents: int, longest: int, max_len: int) -> Path:
    """A small labelled build to train on, in `root / "packed"`: random documents of 5 to `longest`
    tokens with ids 1-499 (0 is left to padding, so a padded row's non-zero prefix is its pack)."""
    from prepack import build

    rng = np.random.default_rng(0)
    ids = [rng.integers(1, 500, size=rng.integers(5, longest)).tolist() for _ in range(documents)]
    labels = [[-100, *doc[1:]] for doc in ids]
    build(write_corpus(root / "corpus.parquet", corpus_table(ids, labels)), root / "packed", max_len=max_len)
    return root / "packed"


def read_build(directory: Path) -> tuple[dict, list[dict]]:
    """The manifest and every pack (as Python lists), read with pyarrow alone."""
    manifest = json.loads((directory / "manifest.json").read_text())
    packs = []
    for shard in manifest["shards"]:
        with pa.memory_map(str(directory / shard["name"])) as source:
            packs.extend(pa.ipc.open_stream(source).read_all().to_pylist())
    return manifest, packs


def reference_placement(
    lengths: list[int], max_len: int, algorithm: str, max_documents: int | None = None,
    images: list[int] | None = None, max_images: int | None = None,
) -> list[int]:
    """Straightforward O(n·packs) first-/best-fit decreasing: pack number of every segment, at most
    `max_documents` segments a pack when given, and at most `max_images` of the segments' `images` a pack."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    images = images or [0] * len(lengths)
    remaining: list[int] = []
    held: list[int] = []
    pictured: list[int] = []
    pack_of = [0] * len(lengths)
    for i in order:
        fits = [p for p, room in enumerate(remaining) if room >= lengths[i] and held[p] != max_documents
                and (max_images is None or pictured[p] + images[i] <= max_images)]
        if not fits:
            remaining.append(max_len)
            held.append(0)
            pictured.append(0)
            fits = [len(remaining) - 1]
        p = fits[0] if algorithm == "ffd" else min(fits, key=lambda q: (remaining[q], q))
        remaining[p] -= lengths[i]
        held[p] += 1
        pictured[p] += images[i]
        pack_of[i] = p
    return pack_of


def files(directory: Path) -> dict[str, bytes]:
    """Every file of a flat directory (a build, a store), name to bytes."""
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def edit_json(path: Path, edit) -> None:
    """Apply `edit` to the JSON object in `path` (a manifest.json or store.json) and write it back."""
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def record_shard(manifest: Path, shard: Path) -> None:
    """Record `shard`'s present size and sha256 in `manifest` (manifest.json or store.json), so that a
    hand-edited shard passes the hash checks and only the structural checks can notice the edit."""
    data = shard.read_bytes()

    def record(raw: dict) -> None:
        entries = [entry for entry in raw["shards"] if entry["name"] == shard.name]  # several: a fuzzed manifest's
        if not entries:  # a KeyError, which the fuzzer takes for "not applicable after an earlier corruption"
            raise KeyError(f"{manifest} lists no shard {shard.name}")
        for entry in entries:
            entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())

    edit_json(manifest, record)


MIXTURE = """\
tokens: {tokens}
seed: 3
pack_within_source: {within}
sources:
  - {{name: web, path: web.parquet, weight: 0.5}}
  - {{name: code, path: code.jsonl, weight: 0.2}}
  - {{name: math, path: math-store, weight: 0.3, max_epochs: 12}}
"""


def mixture_sources(root: Path) -> tuple[dict[str, list[list[int]]], dict[str, list[list[int]] | None]]:
    """The three sources of `MIXTURE` in `root`, and their documents and labels: web (Parquet, with
    labels; upsampled once and a bit at 20,000 tokens), code (JSON Lines, no labels, an empty document,
    some longer than 128; downsampled), math (a document store; upsampled 8 times and more)."""
    from prepack import build_store

    rng = np.random.default_rng(7)

    def documents(count: int, longest: int, first_id: int) -> list[list[int]]:
        return [rng.integers(first_id, first_id + 100, size=rng.integers(1, longest)).tolist() for _ in range(count)]

    docs = {"web": documents(200, 60, 1), "code": documents(100, 300, 200), "math": documents(30, 40, 400)}
    docs["code"][5] = []
    labels = {"web": [[-100, *d[1:]] for d in docs["web"]], "code": None, "math": None}
    write_corpus(root / "web.parquet", corpus_table(docs["web"], labels["web"]))
    write_corpus(root / "code.jsonl", corpus_table(docs["code"]))
    write_corpus(root / "math.parquet", corpus_table(docs["math"]))
    build_store(root / "math.parquet", root / "math-store")
    return docs, labels


def write_mixture(root: Path, name: str = "mix.yaml", tokens: int = 20000, within: bool = False) -> Path:
    """`MIXTURE` as the file `root / name` (its sources from `mixture_sources(root)`)."""
    path = root / name
    path.write_text(MIXTURE.format(tokens=tokens, within=str(within).lower()))
    return path


PAIRS_MAX_LEN = 40  # some pairs of `preference_pairs` are longer: their chosen completions are cut


def preference_pairs(root: Path) -> Path:
    """A preference-pair build (`root / "packed"`, max_len PAIRS_MAX_LEN, overflow truncate) of 40 text pairs
    (`root / "pairs.jsonl"`) made from examples/chitchat's conversations, tokenized with `root / "gpt2"`."""
    from prepack import build
    from tests.demo_inputs import CHATML, chitchat, gpt2_directory

    tokenizer = gpt2_directory(root / "gpt2", CHATML)
    rows = [
        {"prompt": f"Q: {turns[0]} A:", "chosen": f" {turns[1]}", "rejected": " no idea"}
        for turns in chitchat()
        if len(turns) >= 2 and len(turns[0]) < 50  # prompts short enough to truncate the pair around
    ][:40]
    (root / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    build(root / "pairs.jsonl", root / "packed", max_len=PAIRS_MAX_LEN, tokenizer=tokenizer, pairs=True, overflow="truncate", num_proc=1)
    return root / "packed"


# What a fuzzer turns a build's file into when it is no longer a file (tests/attacks/test_fuzz_*.py).
NOT_A_FILE = ("symlink", "fifo", "directory", "dev-zero")


def make_not_a_file(path: Path, kind: str) -> None:
    """Replace the regular file `path` by what `kind` (one of `NOT_A_FILE`) names: a symbolic link to its bytes,
    moved beside its directory ("symlink"), a FIFO, a directory, or a symbolic link to /dev/zero."""
    if kind == "symlink":
        moved = path.parent.parent / f"moved-{path.name}"
        path.rename(moved)
        path.symlink_to(moved)
        return
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
