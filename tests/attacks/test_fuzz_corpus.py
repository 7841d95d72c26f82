"""Fuzz: random corruptions of small valid corpora, in every input format, fed to `prepack.build`.

The contract: a build either succeeds, and then its output verifies against the corpus, or raises a
`PrepackError` and leaves nothing behind (no output directory, no staging sibling). Any other
exception is a bug. Each case draws its corruption from a numpy RNG seeded with (format, case), so a
failure names the seed that replays it. 3,800 cases: 350 per token-id format, 250 per text/chat
format; about 30 s on a 2-core machine.

Token ids: Parquet, JSON Lines (plain, gzip, zstd), Arrow IPC file and stream, zstd-compressed
Feather, a `save_to_disk` directory (its data file or its state.json); bit flips, truncations,
inserted bytes, rewritten list offsets (found by their bytes in the file), values spliced into JSON.
Text and chat: JSON Lines and Parquet, tokenized with a word-level tokenizer in the build.
"""

from __future__ import annotations

import gzip
import json
import shutil
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import zstandard
from tokenizers import Tokenizer, models, pre_tokenizers

from prepack import build
from prepack.errors import PrepackError
from prepack.check.verify import verify_build
from tests.corpus import corpus_table, write_corpus

MAX_LEN = 16
CASES = 350  # per format
# Document lengths 1..9 (labels alongside): small files, so a random byte often lands in the data.
DOCUMENTS = [[(7 * i + j) % 50 for j in range(1 + i % 9)] for i in range(40)]
LABELS = [[-100 if j % 3 == 0 else token for j, token in enumerate(doc)] for doc in DOCUMENTS]
# Replacement values for an Arrow offset: negative, past any buffer, huge, or merely out of order.
OFFSETS = (-1, -(2**31), 2**31 - 1, 2**30, 10**6, 0, 1, 7, 40, 200)
# Values spliced into a JSON document: wrong types, out-of-range ids, nesting, surrogates, junk.
JSON_PIECES = (
    b"-1", b"2147483648", b"18446744073709551616", b"1e400", b"1.5", b"null", b'"x"', b"[1]", b"[[1]]",
    b'"\\ud800"', b"\\ud800", b"\\udfff x", b"\\", b"\\u12", b"{}", b"true", b"NaN", b"\n", b"\n\n",
    b",", b"]", b"}", b"\xff\xfe", b"\x00", b"[" * 3000,
)
FORMATS = ("parquet", "jsonl", "jsonl.gz", "jsonl.zst", "arrow", "ipc", "feather", "hf")  # feather: zstd IPC
COMPRESSORS = {"jsonl.gz": lambda data: gzip.compress(data, mtime=0), "jsonl.zst": zstandard.compress}
DECOMPRESSORS = {"jsonl.gz": gzip.decompress, "jsonl.zst": zstandard.decompress}
WORDS = ("a", "b", "c", "d")
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def flip_bits(rng: np.random.Generator, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.integers(1, 5)):
        i = int(rng.integers(len(out)))
        out[i] ^= 1 << int(rng.integers(8))
    return bytes(out)


def truncate(rng: np.random.Generator, data: bytes) -> bytes:
    return data[: int(rng.integers(len(data)))]


def insert_bytes(rng: np.random.Generator, data: bytes) -> bytes:
    at = int(rng.integers(len(data) + 1))
    return data[:at] + rng.bytes(int(rng.integers(1, 9))) + data[at:]


def rewrite_offset(rng: np.random.Generator, data: bytes) -> bytes:
    """Overwrite one list offset of the input_ids or labels column, found by its bytes in the file."""
    lengths = [len(doc) for doc in DOCUMENTS]
    pattern = np.concatenate([[0], np.cumsum(lengths)]).astype("<i4").tobytes()
    found = [i for i in range(len(data)) if data.startswith(pattern, i)]
    assert found, "the offsets buffer was not found in the Arrow file"
    at = found[int(rng.integers(len(found)))] + 4 * int(rng.integers(len(lengths) + 1))
    value = int(rng.choice(OFFSETS)) if rng.random() < 0.7 else int(rng.integers(-300, 300))
    return data[:at] + np.int32(value).astype("<i4").tobytes() + data[at + 4 :]


def splice_json(rng: np.random.Generator, data: bytes) -> bytes:
    """Replace a number of a JSON Lines file by a bad value, or insert one after a quote (inside a
    string: escapes such as a lone surrogate) or anywhere."""
    numbers = [i for i in range(1, len(data)) if data[i : i + 1].isdigit() and not data[i - 1 : i].isdigit()]
    quotes = [i + 1 for i in range(len(data)) if data[i : i + 1] == b'"']
    places = numbers + quotes if rng.random() < 0.8 else [int(rng.integers(len(data) + 1))]
    at = places[int(rng.integers(len(places)))]
    end = at
    while end < len(data) and data[end : end + 1].isdigit():
        end += 1
    return data[:at] + JSON_PIECES[int(rng.integers(len(JSON_PIECES)))] + data[end:]


def corruptions(kind: str) -> list:
    common = [flip_bits, truncate, insert_bytes]
    if kind in ("arrow", "ipc", "hf"):
        return [*common, rewrite_offset, rewrite_offset]
    if kind == "jsonl":
        return [*common, splice_json, splice_json]
    return common


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """Per format: the corpus files (relative name → bytes) of one valid corpus."""
    from datasets import Dataset

    root = tmp_path_factory.mktemp("originals")
    table = corpus_table(DOCUMENTS, LABELS)
    files = {}
    for kind in ("parquet", "jsonl", "arrow", "ipc"):
        files[kind] = {f"c.{kind}": write_corpus(root / f"c.{kind}", table).read_bytes()}
    for kind, compress in COMPRESSORS.items():
        files[kind] = {f"c.{kind}": compress(files["jsonl"]["c.jsonl"])}
    feather.write_feather(table, root / "c.feather", compression="zstd")
    files["feather"] = {"c.feather": (root / "c.feather").read_bytes()}
    saved = root / "hf"
    Dataset.from_dict({"input_ids": DOCUMENTS, "labels": LABELS}).save_to_disk(str(saved))
    files["hf"] = {p.name: p.read_bytes() for p in saved.iterdir() if p.is_file()}
    return files


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A word-level tokenizer with an EOS token and a chat template: tokenizing costs next to nothing."""
    directory = tmp_path_factory.mktemp("tokenizer")
    vocab = {word: i for i, word in enumerate(("[UNK]", "</s>", ":", *WORDS, "user", "assistant"))}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "</s>", "chat_template": TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def text_corpus(mode: str, suffix: str) -> bytes:
    """A valid text or chat corpus of 30 rows, as JSON Lines or Parquet bytes."""
    texts = [" ".join(WORDS[(i + j) % 4] for j in range(i % 7)) for i in range(30)]
    if mode == "chat":
        turns = [[{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}] for t in texts]
        rows = [{"messages": messages} for messages in turns]
    else:
        rows = [{"text": t} for t in texts]
    if suffix == "jsonl":
        return "".join(json.dumps(row) + "\n" for row in rows).encode()
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


def run_case(workdir: Path, kind: str, files: dict[str, bytes], seed: int) -> str:
    """Corrupt one file of the corpus, build it, check the outcome; returns "built" or "refused".

    A compressed JSON Lines file is corrupted either before compression (bad records in a sound
    stream) or after (a broken stream)."""
    rng = np.random.default_rng([FORMATS.index(kind), seed])
    corpus = workdir / f"corpus-{kind}-{seed}"
    corpus.mkdir()
    (target,) = [name for name in files if name.startswith(("c.", "data-"))]
    compress = COMPRESSORS.get(kind) if rng.random() < 0.5 else None
    if kind == "hf" and rng.random() < 0.2:
        target, choices = "state.json", [flip_bits, splice_json]
    else:
        choices = corruptions("jsonl" if compress else kind)
    corrupt = choices[int(rng.integers(len(choices)))]
    for name, data in files.items():
        if name == target and compress:
            data = compress(corrupt(rng, DECOMPRESSORS[kind](data)))
        elif name == target:
            data = corrupt(rng, data)
        (corpus / name).write_bytes(data)
    source = corpus if kind == "hf" else corpus / target
    return check_build(workdir, corpus, source, f"{kind} seed {seed} ({corrupt.__name__})")


def check_build(workdir: Path, corpus: Path, source: Path, case: str, **options) -> str:
    """Build `source` (in `corpus`, which is removed after); a success must verify, a PrepackError
    must leave nothing. Returns "built" or "refused"."""
    out = workdir / f"out-{corpus.name}"
    try:
        build(source, out, max_len=MAX_LEN, **options)
    except PrepackError:
        assert not out.exists(), f"{case}: a failed build left {out}"
        left = [p.name for p in workdir.iterdir() if p.name.startswith(f".{out.name}.")]
        assert not left, f"{case}: a failed build left {left}"
        outcome = "refused"
    else:
        # Chat is verified against the shards alone: re-tokenizing it starts a process pool per call.
        if options.get("chat"):
            problems = verify_build(out)
        else:
            problems = verify_build(out, source, **({"tokenizer": options["tokenizer"]} if options else {}))
        assert not problems, f"{case}: the build does not verify: {problems}"
        outcome = "built"
        shutil.rmtree(out)
    shutil.rmtree(corpus)
    return outcome


@pytest.mark.slow
@pytest.mark.parametrize("kind", FORMATS)
def test_corrupted_corpora_build_cleanly_or_raise_a_prepack_error(tmp_path, originals, kind):
    outcomes, failures = Counter(), []
    for seed in range(CASES):
        try:
            outcomes[run_case(tmp_path, kind, originals[kind], seed)] += 1
        except Exception as exc:  # noqa: BLE001 - every other exception is the finding
            lines = traceback.format_exception(exc)
            failures.append(f"{kind} seed {seed}: {''.join(lines[-3:]).strip()}")
    assert not failures, f"{len(failures)} of {CASES} cases broke the contract:\n" + "\n\n".join(failures[:8])
    # Both outcomes happen: the corruptions reach the data, and not every change is fatal.
    assert outcomes["refused"] > CASES // 10 and outcomes["built"] > 0, outcomes


TEXT_CASES = 250  # per mode and format


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["text", "chat"])
@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_corrupted_text_and_chat_corpora_tokenize_cleanly_or_raise_a_prepack_error(tmp_path, tokenizer, mode, suffix):
    valid = text_corpus(mode, suffix)
    choices = [flip_bits, truncate, insert_bytes, *([splice_json] * 3 if suffix == "jsonl" else [])]
    outcomes, failures = Counter(), []
    for seed in range(TEXT_CASES):
        rng = np.random.default_rng([len(FORMATS), seed])
        corrupt = choices[int(rng.integers(len(choices)))]
        corpus = tmp_path / f"corpus-{seed}"
        corpus.mkdir()
        source = corpus / f"c.{suffix}"
        source.write_bytes(corrupt(rng, valid))
        case = f"{mode} {suffix} seed {seed} ({corrupt.__name__})"
        try:
            options = {"tokenizer": tokenizer, "chat": mode == "chat", "num_proc": 1}
            outcomes[check_build(tmp_path, corpus, source, case, **options)] += 1
        except Exception as exc:  # noqa: BLE001 - every other exception is the finding
            failures.append(f"{case}: {''.join(traceback.format_exception(exc)[-3:]).strip()}")
    assert not failures, f"{len(failures)} of {TEXT_CASES} cases broke the contract:\n" + "\n\n".join(failures[:8])
    assert outcomes["refused"] > TEXT_CASES // 10 and outcomes["built"] > 0, outcomes
