"""Untrusted input bytes are validated before use: every failure is an InputError naming the file, the
row and the column, and nothing is written. Corrupt Arrow files are made by editing the bytes of real
ones (the offsets buffer found in the file and overwritten), not by mocking a reader."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import prepack.sources.corpus
from prepack import build
from prepack.errors import InputError
from prepack.storage.output import STAGING_MARK
from prepack.check.verify import verify_build
from tests.corpus import corpus_table, read_build, write_corpus

DOCUMENTS = [[11, 12, 13], [21, 22, 23, 24, 25], [31] * 7]
OFFSETS = [0, 3, 8, 15]


def assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def refused(corpus, out: Path, fragments: list[str], **options) -> InputError:
    with pytest.raises(InputError) as error:
        build(corpus, out, **{"max_len": 16, **options})
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))
    assert_nothing_written(out)
    return error.value


def edit_offsets(path: Path, offsets: list[int], occurrence: int = 0) -> Path:
    """Overwrite the `occurrence`-th copy of the int32 offsets buffer [0, 3, 8, 15] in the file."""
    data = bytearray(path.read_bytes())
    pattern = np.array(OFFSETS, "<i4").tobytes()
    at = -1
    for _ in range(occurrence + 1):
        at = data.find(pattern, at + 1)
    assert at >= 0, "offsets buffer not found"
    data[at : at + len(pattern)] = np.array(offsets, "<i4").tobytes()
    path.write_bytes(bytes(data))
    return path


def arrow_corpus(path: Path, labels: bool = False) -> Path:
    table = corpus_table(DOCUMENTS, DOCUMENTS if labels else None)
    return write_corpus(path, table)


# name: (offsets written over [0, 3, 8, 15], the row named in the error)
BAD_OFFSETS = {
    "negative": ([0, 3, -2, 15], "row 1"),
    "non-monotonic": ([0, 8, 3, 15], "row 1"),
    "past the values": ([0, 3, 8, 40], "row 2"),
    "huge last offset": ([0, 3, 8, 2**31 - 1], "row 2"),
    "negative first": ([-4, 3, 8, 15], "row 0"),
}


@pytest.mark.parametrize("suffix", [".arrow", ".ipc"])  # the IPC file and stream formats
@pytest.mark.parametrize("case", BAD_OFFSETS)
def test_corrupt_arrow_offsets_are_refused_with_row_and_column(tmp_path, suffix, case):
    offsets, row = BAD_OFFSETS[case]
    corpus = edit_offsets(arrow_corpus(tmp_path / f"c{suffix}"), offsets)
    refused(corpus, tmp_path / "out", [f"c{suffix}", row, "column 'input_ids'", "corrupt"])


def test_corrupt_labels_offsets_name_the_labels_column(tmp_path):
    corpus = edit_offsets(arrow_corpus(tmp_path / "c.arrow", labels=True), [0, 8, 3, 15], occurrence=1)
    refused(corpus, tmp_path / "out", ["c.arrow", "row 1", "column 'labels'"])


def test_valid_arrow_offsets_still_build(tmp_path):
    for suffix in (".arrow", ".ipc"):
        build(arrow_corpus(tmp_path / f"c{suffix}"), tmp_path / f"out{suffix}", max_len=16)
        _, packs = read_build(tmp_path / f"out{suffix}")
        assert sorted(sum((p["input_ids"] for p in packs), [])) == sorted(sum(DOCUMENTS, []))


def test_a_huge_offset_in_a_tiny_file_does_not_allocate(tmp_path):
    """730 bytes claiming 2^31 tokens: refused under a 4 GiB address-space limit, in a fresh process."""
    corpus = edit_offsets(arrow_corpus(tmp_path / "c.arrow"), [0, 3, 8, 2**31 - 1])
    assert corpus.stat().st_size < 1024

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))

    result = subprocess.run(
        [sys.executable, "-c", "from prepack.cli import app; app()", "build", str(corpus), "--max-len", "16",
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, preexec_fn=limit, timeout=120, env={**os.environ, "COLUMNS": "300"},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "row 2, column 'input_ids'" in result.stderr and "Traceback" not in result.stderr
    assert_nothing_written(tmp_path / "out")


# Hugging Face save_to_disk directories


def saved_dataset(directory: Path) -> Path:
    from datasets import Dataset

    Dataset.from_dict({"input_ids": DOCUMENTS}).save_to_disk(str(directory))
    return directory


def set_data_files(directory: Path, names: list[str]) -> None:
    state = json.loads((directory / "state.json").read_text())
    state["_data_files"] = [{"filename": name} for name in names]
    (directory / "state.json").write_text(json.dumps(state))


def test_saved_dataset_builds(tmp_path):
    build(saved_dataset(tmp_path / "ds"), tmp_path / "out", max_len=16)
    manifest, _ = read_build(tmp_path / "out")
    assert manifest["totals"]["documents"] == 3


@pytest.mark.parametrize("escape", ["parent", "absolute", "symlink out"])
def test_saved_dataset_file_names_stay_inside_the_directory(tmp_path, escape):
    directory = saved_dataset(tmp_path / "ds")
    outside = write_corpus(tmp_path / "outside.arrow", corpus_table(DOCUMENTS))
    name = {"parent": "../outside.arrow", "absolute": str(outside), "symlink out": "link.arrow"}[escape]
    if escape == "symlink out":
        (directory / "link.arrow").symlink_to(outside)
    set_data_files(directory, [name])
    refused(directory, tmp_path / "out", ["state.json", repr(name), "outside the dataset directory"])


@pytest.mark.parametrize(
    "name, fragment",
    [("", "state.json"), ("a\udfff.arrow", "state.json"), ("a\u0000.arrow", "state.json"), (7, "state.json"),
     ("a directory.arrow", "a directory.arrow: cannot be read as a corpus file: it is a directory")],
)
def test_saved_dataset_file_names_that_are_no_files_are_refused(tmp_path, name, fragment):
    directory = saved_dataset(tmp_path / "ds")
    if name == "a directory.arrow":
        (directory / name).mkdir()
    set_data_files(directory, [name])
    refused(directory, tmp_path / "out", [fragment])


def build_in_thread(corpus: Path, out: Path) -> BaseException | None:
    """Build in a daemon thread, so a build that blocks (on a FIFO) fails the test instead of hanging it."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            build(corpus, out, max_len=16)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the build blocks"
    return outcome[0]


def test_saved_dataset_data_file_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    directory = saved_dataset(tmp_path / "ds")
    os.mkfifo(directory / "pipe.arrow")
    set_data_files(directory, ["pipe.arrow"])
    error = build_in_thread(directory, tmp_path / "out")
    assert isinstance(error, InputError) and "pipe.arrow" in str(error) and "FIFO" in str(error)
    assert_nothing_written(tmp_path / "out")


def test_saved_dataset_arrow_data_is_validated(tmp_path):
    directory = saved_dataset(tmp_path / "ds")
    (data_file,) = directory.glob("data-*.arrow")
    edit_offsets(data_file, [0, 3, -2, 15])
    refused(directory, tmp_path / "out", [data_file.name, "row 1", "column 'input_ids'"])


# Parquet and JSON Lines values


def jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


# case: (the input_ids column: an Arrow array for Parquet, JSON texts for JSON Lines; expected fragments;
# a record that is not JSON has no column to name)
BAD_VALUES = {
    "parquet negative id": (pa.array([[1], [2, -3]]), ["'input_ids'", "row 1", "-3"]),
    "parquet uint64 id over int32": (
        pa.array([[1], [2**32]], pa.list_(pa.uint64())), ["'input_ids'", "row 1", str(2**32)]
    ),
    "parquet null id": (pa.array([[1], [2, None]]), ["'input_ids'", "row 1", "null token id"]),
    "parquet string ids": (pa.array([["1"]]), ["'input_ids'", "must be integers"]),
    "jsonl negative id": (["[1]", "[1, -7]"], ["'input_ids'", "row 1", "-7"]),
    "jsonl id over int32": (["[1]", "[2147483648]"], ["'input_ids'", "row 1", "2147483648"]),
    "jsonl id over int64": (
        ["[1]", "[1]", "[18446744073709551616]"], ["'input_ids'", "row 2", "18446744073709551616", "out of range"]
    ),
    "jsonl null row": (["[1]", "null"], ["'input_ids'", "row 1", "null"]),
    "jsonl null id": (["[1, null]"], ["'input_ids'", "row 0", "null token id"]),
    "jsonl a number instead of a list": (["[1]", "5"], ["'input_ids'", "row 1", "expected a list of token ids"]),
    "jsonl nested lists": (["[1]", "[[1]]"], ["'input_ids'", "row 1", "nested"]),
    "jsonl nested too deeply": (["[1]", "[" * 100_000], ["row 1", "not valid JSON", "nested too deeply"]),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_bad_parquet_and_jsonl_values_name_file_row_column(tmp_path, case):
    values, fragments = BAD_VALUES[case]
    if isinstance(values, pa.Array):
        corpus = tmp_path / "c.parquet"
        pq.write_table(pa.table({"input_ids": values}), corpus)
    else:
        corpus = jsonl(tmp_path / "c.jsonl", [f'{{"input_ids": {value}}}' for value in values])
    refused(corpus, tmp_path / "out", [corpus.name, *fragments])


@pytest.mark.slow
def test_a_jsonl_record_over_one_mib_is_read(tmp_path):
    long = list(range(800_000))  # 3.4 MiB of JSON, more than pyarrow's 1 MiB block
    lines = [json.dumps({"input_ids": [1, 2]}), json.dumps({"input_ids": long}), json.dumps({"input_ids": [3]})]
    corpus = jsonl(tmp_path / "c.jsonl", lines * 2)
    assert len(lines[1]) > 3 * 2**20
    manifest = build(corpus, tmp_path / "out", max_len=2**20)
    assert manifest.totals.documents == 6 and manifest.totals.input_tokens == 2 * (3 + len(long))
    _, packs = read_build(tmp_path / "out")
    assert sorted(len(p["input_ids"]) for p in packs) == [len(long), len(long) + 6]
    assert verify_build(tmp_path / "out", corpus) == []  # every token as the corpus has it


def test_a_jsonl_record_over_the_bound_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(prepack.sources.corpus, "MAX_RECORD_BYTES", 2**20)  # the real bound is 256 MiB
    lines = [json.dumps({"input_ids": [1]}), json.dumps({"input_ids": list(range(300_000))})]
    refused(jsonl(tmp_path / "c.jsonl", lines), tmp_path / "out", ["c.jsonl", "row 1", f"longer than {2**20} bytes"])


# Options and text


@pytest.mark.parametrize(
    "options, fragments",
    [
        ({"seed": -1}, ["seed", "greater than or equal to 0"]),
        ({"shard_size": 0}, ["shard_size", "greater than or equal to 1"]),
        ({"algorithm": "nfd"}, ["algorithm", "'ffd' or 'bfd'", "'nfd'"]),
        ({"overflow": "wrap"}, ["overflow", "'wrap'"]),
        ({"seed": -1, "max_len": 0}, ["max_len", "seed"]),
    ],
)
def test_invalid_options_are_refused_before_anything_is_written(tmp_path, options, fragments):
    corpus = jsonl(tmp_path / "c.jsonl", ['{"input_ids": [1, 2]}'])
    refused(corpus, tmp_path / "out", ["invalid build options", *fragments], **options)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1, "a": 2, "b": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(directory / "tokenizer.json"))
    template = "{% for m in messages %}{{ m.role }} {{ m.content }}\n{% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": template}))
    return directory


@pytest.mark.parametrize("chat", [False, True])
def test_a_lone_surrogate_is_refused_with_row_and_column(tmp_path, tokenizer, chat):
    good, bad = ("a b", "a \\ud800 b")
    if chat:
        lines = [f'{{"messages": [{{"role": "user", "content": "{text}"}}]}}' for text in (good, good, bad)]
    else:
        lines = [f'{{"text": "{text}"}}' for text in (good, good, bad)]
    corpus = jsonl(tmp_path / "c.jsonl", lines)
    column = "'messages'" if chat else "'text'"
    fragments = ["c.jsonl", "row 2", column, "surrogate"]
    refused(corpus, tmp_path / "out", fragments, tokenizer=tokenizer, chat=chat, num_proc=1)


# What a corpus directory may hold


def corpus_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "corpus"
    directory.mkdir()
    jsonl(directory / "a.jsonl", ['{"input_ids": [1, 2]}'])
    return directory


@pytest.mark.parametrize("link", ["dangling", "loop"])
def test_a_symlink_to_nothing_in_the_corpus_is_refused(tmp_path, link):
    directory = corpus_dir(tmp_path)
    (directory / "b.jsonl").symlink_to(tmp_path / "gone.jsonl" if link == "dangling" else directory / "b.jsonl")
    what = "symbolic link to nothing" if link == "dangling" else "Too many levels of symbolic links"
    refused(directory, tmp_path / "out", ["b.jsonl", what])
    refused(directory / "b.jsonl", tmp_path / "out", ["b.jsonl", what])


def test_a_fifo_in_the_corpus_is_refused_without_blocking(tmp_path):
    directory = corpus_dir(tmp_path)
    os.mkfifo(directory / "b.jsonl")
    for corpus in (directory, directory / "b.jsonl", directory / "*.jsonl"):
        error = build_in_thread(corpus, tmp_path / "out")
        assert isinstance(error, InputError) and "b.jsonl" in str(error) and "FIFO" in str(error), error
        assert_nothing_written(tmp_path / "out")


def test_a_subdirectory_that_cannot_be_listed_is_refused(tmp_path):
    """A directory under a path longer than PATH_MAX: even root cannot list it (chmod would not stop
    root), and its documents must not be left out quietly."""
    directory = corpus_dir(tmp_path)
    parent = os.open(directory, os.O_RDONLY)
    for _ in range(20):  # 20 levels of 250 characters: past Linux's 4,096
        os.mkdir("d" * 250, dir_fd=parent)
        child = os.open("d" * 250, os.O_RDONLY, dir_fd=parent)
        os.close(parent)
        parent = child
    with open(os.open("b.jsonl", os.O_WRONLY | os.O_CREAT, dir_fd=parent), "w") as deep:
        deep.write('{"input_ids": [3]}\n')
    os.close(parent)
    refused(directory, tmp_path / "out", ["ddd", "cannot list this corpus directory"])


def test_a_symlinked_subdirectory_is_read(tmp_path):
    directory = corpus_dir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    jsonl(elsewhere / "b.jsonl", ['{"input_ids": [3, 4]}'])
    (directory / "more").symlink_to(elsewhere)
    manifest = build(directory, tmp_path / "out", max_len=16)
    assert [f.path for f in manifest.inputs] == ["a.jsonl", "more/b.jsonl"] and manifest.totals.documents == 2


def test_a_directory_reached_twice_through_a_symlink_is_refused(tmp_path):
    directory = corpus_dir(tmp_path)
    (directory / "loop").symlink_to(directory)
    refused(directory, tmp_path / "out", ["loop", "reached twice"])


def test_a_directory_named_like_a_corpus_file_is_read_as_a_directory(tmp_path):
    directory = corpus_dir(tmp_path)
    (directory / "part.parquet").mkdir()  # how Spark writes a Parquet data set
    pq.write_table(pa.table({"input_ids": [[3, 4, 5]]}), directory / "part.parquet" / "0.parquet")
    assert build(directory, tmp_path / "out", max_len=16).totals.documents == 2


def test_an_earlier_build_inside_the_corpus_is_refused(tmp_path):
    directory = tmp_path / "corpus"
    directory.mkdir()
    # int32 ids, the shards' own type: nothing but the check below tells the shards from the corpus.
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2]], pa.list_(pa.int32()))}), directory / "a.parquet")
    build(directory, tmp_path / "first", max_len=16)
    os.rename(tmp_path / "first", directory / "packed")
    refused(directory, tmp_path / "out", ["packed/shard-00000.arrow: a shard of the prepack build", "corpus/packed"])
    # The shards alone, copied out of their build: their schema marks them.
    (tmp_path / "copied").mkdir()
    os.rename(directory / "packed" / "shard-00000.arrow", tmp_path / "copied" / "shard-00000.arrow")
    refused(tmp_path / "copied", tmp_path / "out", ["copied/shard-00000.arrow: a shard of a prepack build"])


def test_a_manifest_json_that_is_not_prepacks_does_not_refuse_the_corpus(tmp_path):
    directory = corpus_dir(tmp_path)
    (directory / "manifest.json").write_text('{"name": "my corpus"}')
    assert build(directory, tmp_path / "out", max_len=16).totals.documents == 1


def test_a_running_builds_staging_directory_in_the_corpus_is_not_read(tmp_path):
    directory = corpus_dir(tmp_path)
    staging = directory / ".packed.tmp-0123abcd"
    staging.mkdir()
    (staging / STAGING_MARK).touch()
    write_corpus(staging / "shard-00000.arrow", corpus_table([[9, 9, 9]]))
    manifest = build(directory, tmp_path / "out", max_len=16)
    assert [f.path for f in manifest.inputs] == ["a.jsonl"] and manifest.totals.documents == 1


def test_a_users_directory_named_like_a_staging_directory_is_read(tmp_path):
    """Only prepack's mark makes a directory a build's staging directory: a look-alike is corpus."""
    directory = corpus_dir(tmp_path)
    (directory / ".packed.tmp-0123abcd").mkdir()
    write_corpus(directory / ".packed.tmp-0123abcd" / "b.parquet", corpus_table([[9, 9, 9]]))
    manifest = build(directory, tmp_path / "out", max_len=16)
    assert manifest.totals.documents == 2
