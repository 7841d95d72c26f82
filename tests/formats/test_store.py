"""The document store: tokenize once, build many. A build of a store is byte for byte the build of its
corpus; the store's bytes are pinned; a broken store, or a build and a store mistaken for each other,
is refused by name."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prepack import build, build_store
from prepack.errors import FormatError, InputError, OutputError
from prepack.formats.shards import read_manifest
from prepack.formats.store import (
    PAIR_STORE_VERSION,
    STORE_VERSION,
    STORE_VERSION_KEY,
    read_store_manifest,
    store_schema,
)
from prepack.sources.store import open_store
from prepack.check.verify import verify_build
from prepack.storage.files import write_record_batch
from tests.cli import WIDE, invoke_prepack, run_prepack
from tests.corpus import corpus_table, edit_json, files, write_corpus
from tests.demo_inputs import CHATML, as_chat, chitchat, gpt2_directory

SCHEMAS = Path(__file__).parents[2] / "schemas"
# The golden store: `_golden_corpus` tokenized with `shard_size=64`. Its bytes change only with the
# store format, which then bumps STORE_VERSION. The fingerprint is a build's (see test below).
GOLDEN_SHA256 = {
    "documents-00000.arrow": "47794658f99cc19199e3d4ec55b86b62d5e92fa9afeb78ab230da0cb67a44b33",
    "documents-00001.arrow": "f7fe61b7c3289622df6a9905dbcbc25f0967a0d5b34b5b793c4977805f12df01",
    "documents-00002.arrow": "4e15de6aed72c21cc49e2402fda06e63a550d9db505faabb7791abdf4bf46d8f",
    "fingerprint": "c4b4fca36cc19b959570dc2f040edfcb0e9c258b56b6fdbaa702c8849029d588",
}


# The spec and the code -------------------------------------------------------------------------


def test_store_format_page_lists_the_columns_of_the_code():
    page = (SCHEMAS / "store-format.md").read_text()
    documented = dict(re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", page, flags=re.MULTILINE))
    schema = store_schema(has_labels=True)
    assert documented == {field.name: f"list<{field.type.value_type}>" for field in schema}
    # The page's version is the newest store.json's; its shards' (STORE_VERSION) has not changed since 1.
    assert f"version {PAIR_STORE_VERSION}" in page.splitlines()[0]
    assert f"shards: version {STORE_VERSION}" in page.splitlines()[0]
    assert f'`{STORE_VERSION_KEY}` = `"{STORE_VERSION}"`' in page
    assert schema.metadata == {STORE_VERSION_KEY.encode(): str(STORE_VERSION).encode()}


# Golden bytes ------------------------------------------------------------------------------------


def _golden_corpus(tmp_path: Path) -> Path:
    """Two files, an empty document, labels with -100, documents that do not fit one shard."""
    (tmp_path / "corpus").mkdir()
    write_corpus(tmp_path / "corpus" / "a.parquet", corpus_table([[5, 6, 7], [], [1] * 9], [[-100, 6, 7], [], [1] * 9]))
    write_corpus(tmp_path / "corpus" / "b.jsonl", corpus_table([[2, 3], [4]], [[-100, -100], [4]]))
    return tmp_path / "corpus"


def test_golden_store(tmp_path):
    manifest = build_store(_golden_corpus(tmp_path), tmp_path / "store", shard_size=64)
    stored = files(tmp_path / "store")
    got = {name: hashlib.sha256(data).hexdigest() for name, data in stored.items() if name != "store.json"}
    assert {**got, "fingerprint": manifest.fingerprint} == GOLDEN_SHA256
    # 64 bytes hold 8 tokens with labels: [5,6,7] [] | [1]*9 alone | [2,3] [4].
    assert [(s.documents, s.tokens) for s in manifest.shards] == [(2, 3), (1, 9), (2, 3)]
    assert [(f.path, f.rows) for f in manifest.inputs] == [("a.parquet", 3), ("b.jsonl", 2)]
    assert manifest.lengths.model_dump() == {
        "min": 0, "max": 9, "mean": 3.0, "p50": 2, "p90": 3, "p99": 3, "empty": 1, "untrained": 2,  # [2, 3] and [4]: nothing trained after the first token
    }
    with pa.ipc.open_stream(tmp_path / "store" / "documents-00000.arrow") as reader:
        assert reader.read_all().to_pylist() == [
            {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
            {"input_ids": [], "labels": []},
        ]
    # The store.json is what its model writes, keys sorted (no `generations` nor `length_counts` key: never appended to;
    # no `pairs`: a store of documents);
    # written twice, the same bytes.
    assert json.loads(stored["store.json"]) == manifest.model_dump(mode="json", exclude={"generations", "length_counts", "pairs"})
    (tmp_path / "again").mkdir()
    build_store(_golden_corpus(tmp_path / "again"), tmp_path / "again" / "store", shard_size=64)
    assert files(tmp_path / "again" / "store") == stored


def test_the_fingerprint_is_the_specs_and_the_builds(tmp_path):
    corpus = _golden_corpus(tmp_path)
    manifest = build_store(corpus, tmp_path / "store", shard_size=64)
    # schemas/store-format.md, computed here from its words alone.
    lengths, ids = [3, 0, 9, 2, 1], [5, 6, 7, *[1] * 9, 2, 3, 4]
    labels = [-100, 6, 7, *[1] * 9, -100, -100, 4]
    streams = [np.array(lengths, "<i8"), np.array(ids, "<i4"), np.array(labels, "<i4")]
    spec = hashlib.sha256(b"".join(hashlib.sha256(s.tobytes()).digest() for s in streams)).hexdigest()
    assert manifest.fingerprint == spec == GOLDEN_SHA256["fingerprint"]
    assert build(corpus, tmp_path / "packed", max_len=4).fingerprint == manifest.fingerprint


def test_shards_depend_on_the_documents_not_on_their_files(tmp_path):
    rng = np.random.default_rng(1)
    documents = [rng.integers(0, 50, size=n).tolist() for n in rng.integers(0, 40, size=200)]
    write_corpus(tmp_path / "one.parquet", corpus_table(documents))
    (tmp_path / "three").mkdir()
    for part, (start, end) in enumerate([(0, 7), (7, 150), (150, 200)]):
        write_corpus(tmp_path / "three" / f"{part}.jsonl", corpus_table(documents[start:end]))
    one = build_store(tmp_path / "one.parquet", tmp_path / "store-one", shard_size=300)
    three = build_store(tmp_path / "three", tmp_path / "store-three", shard_size=300)
    assert one.shards == three.shards and one.fingerprint == three.fingerprint
    assert [f.rows for f in three.inputs] == [7, 143, 50]
    assert all(s.tokens <= 75 or s.documents == 1 for s in one.shards)  # 300 bytes: 75 int32 tokens


# A store builds what its corpus builds -------------------------------------------------------------


def _same_build(direct: Path, from_store: Path) -> None:
    assert files(direct) == files(from_store)  # shards and manifest, byte for byte


@pytest.mark.slow
def test_a_store_of_token_ids_builds_byte_identical(tmp_path):
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 1000, size=n).tolist() for n in rng.integers(0, 90, size=300)]
    labels = [[-100 if rng.random() < 0.3 else t for t in d] for d in documents]
    (tmp_path / "c").mkdir()
    write_corpus(tmp_path / "c" / "0.parquet", corpus_table(documents[:120], labels[:120]))
    write_corpus(tmp_path / "c" / "1.jsonl.gz", corpus_table(documents[120:], labels[120:]))
    build_store(tmp_path / "c", tmp_path / "store", shard_size=900)
    assert len(read_store_manifest(tmp_path / "store").shards) > 3  # shards cut across both files
    for options in ({"max_len": 64}, {"max_len": 40, "algorithm": "bfd", "seed": 3, "drop_untrained": True}):
        build(tmp_path / "c", tmp_path / "direct", shard_size=4000, **options)
        build(tmp_path / "store", tmp_path / "from-store", shard_size=4000, **options)
        _same_build(tmp_path / "direct", tmp_path / "from-store")
        # Its inputs are the corpus's files: verify checks every token against the corpus.
        assert verify_build(tmp_path / "from-store", tmp_path / "c") == []
        shutil.rmtree(tmp_path / "direct"), shutil.rmtree(tmp_path / "from-store")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    return gpt2_directory(tmp_path_factory.mktemp("tok") / "gpt2", CHATML)


@pytest.mark.parametrize("mode", ["text", "chat"])
@pytest.mark.slow
def test_a_tokenized_store_builds_byte_identical_at_two_max_lens(tmp_path, gpt2, mode):
    conversations = chitchat()[:800]
    (tmp_path / "c").mkdir()
    for part, rows in enumerate((conversations[:500], conversations[500:])):
        column = {"text": ["\n".join(t) for t in rows]} if mode == "text" else {"messages": [as_chat(t) for t in rows]}
        pq.write_table(pa.table(column), tmp_path / "c" / f"{part}.parquet")
    reading = {"tokenizer": gpt2, "chat": mode == "chat", "num_proc": 1}
    store = build_store(tmp_path / "c", tmp_path / "store", shard_size=2**16, **reading)
    assert store.has_labels == (mode == "chat") and store.tokenize.mode == mode
    assert len(store.shards) > 1
    for max_len in (256, 1024):
        direct = build(tmp_path / "c", tmp_path / f"direct-{max_len}", max_len=max_len, shard_size=2**17, **reading)
        packed = build(tmp_path / "store", tmp_path / f"store-{max_len}", max_len=max_len, shard_size=2**17)
        assert packed.fingerprint == direct.fingerprint == store.fingerprint
        assert packed.options.tokenize == store.tokenize
        _same_build(tmp_path / f"direct-{max_len}", tmp_path / f"store-{max_len}")


@pytest.mark.slow
def test_the_cli_tokenizes_then_builds(tmp_path, gpt2):
    pq.write_table(pa.table({"text": ["\n".join(t) for t in chitchat()[:100]]}), tmp_path / "c.parquet")
    tokenized = run_prepack("tokenize", tmp_path / "c.parquet", "--out", tmp_path / "store", "--tokenizer", gpt2, "--no-eos")
    assert tokenized.returncode == 0, tokenized.stderr
    assert "stored 100 documents" in " ".join(tokenized.stdout.split())
    built = invoke_prepack("build", tmp_path / "store", "--out", tmp_path / "packed", "--max-len", "128", "-q")
    assert built.returncode == 0, built.stderr
    assert read_manifest(tmp_path / "packed").options.tokenize.eos is False


# Broken stores, and a build and a store mistaken for each other ------------------------------------


@pytest.fixture
def store(tmp_path) -> Path:
    build_store(_golden_corpus(tmp_path), tmp_path / "store", shard_size=64)
    return tmp_path / "store"


def _build_fails(store: Path, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        build(store, store.parent / "packed", max_len=8)
    assert not (store.parent / "packed").exists()


def test_a_changed_shard_is_refused(store):
    path = store / "documents-00001.arrow"
    data = bytearray(path.read_bytes())
    data[-20] ^= 1  # same size, other bytes
    path.write_bytes(bytes(data))
    _build_fails(store, FormatError, r"documents-00001.arrow: its sha256 is not the store manifest's")


def test_a_truncated_shard_is_refused(store):
    path = store / "documents-00002.arrow"
    path.write_bytes(path.read_bytes()[:-8])
    _build_fails(store, FormatError, r"documents-00002.arrow: \d+ bytes, but the store manifest says")


def test_a_store_manifest_is_read_from_its_bytes_and_named_as_its_caller_says(store):
    data = (store / "store.json").read_bytes()
    assert read_store_manifest(data, "s3://bucket/store/store.json") == read_store_manifest(store)
    raw = json.loads(data)
    raw["store_version"] = PAIR_STORE_VERSION + 1
    with pytest.raises(FormatError, match=rf"^s3://bucket/store/store.json: column 'store_version': has store_version {PAIR_STORE_VERSION + 1};"):
        read_store_manifest(json.dumps(raw).encode(), "s3://bucket/store/store.json")


def test_a_missing_store_shard_is_a_problem_with_its_file_as_a_field(store):
    (store / "documents-00001.arrow").unlink()
    with pytest.raises(FormatError) as refused:
        open_store(store)
    assert refused.value.problem.file == str(store / "documents-00001.arrow")
    assert refused.value.problem.message.startswith("missing; the store manifest lists it with ")


def test_a_shard_that_is_a_symbolic_link_is_refused(store, tmp_path):
    shutil.move(store / "documents-00000.arrow", tmp_path / "elsewhere.arrow")
    (store / "documents-00000.arrow").symlink_to(tmp_path / "elsewhere.arrow")
    _build_fails(store, FormatError, "documents-00000.arrow: not a regular file")


def test_names_outside_the_store_are_refused(store):
    edit_json(store / "store.json", lambda raw: raw["shards"][0].update(name="../documents-00000.arrow"))
    _build_fails(store, FormatError, r"shard 0 is named '../documents-00000.arrow'")


@pytest.mark.parametrize("name", ["../a.parquet", "/etc/a.parquet", "x/./a.parquet", "a\0.parquet", "", "x" * 256])
def test_input_names_outside_the_corpus_root_are_refused(store, name):
    edit_json(store / "store.json", lambda raw: raw["inputs"][0].update(path=name))
    _build_fails(store, FormatError, r"inputs.0.path\n.*(is not a relative path|has a part|holds a NUL)")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda raw: raw.update(store_version=PAIR_STORE_VERSION + 1), f"store_version {PAIR_STORE_VERSION + 1}"),
        (lambda raw: raw.update(extra=1), "Extra inputs are not permitted"),
        (lambda raw: raw.update(documents=raw["documents"] + 1), "add up to 5 documents, but it says 6"),
        (lambda raw: raw["shards"][0].update(tokens=4), "add up to 16 tokens, but it says 15"),
    ],
)
def test_a_manifest_that_breaks_the_format_is_refused(store, edit, message):
    edit_json(store / "store.json", edit)
    _build_fails(store, FormatError, message)


def test_a_shard_with_a_negative_id_is_refused_even_with_its_hash(store):
    """A store made by hand with a matching manifest still never hands a negative id on."""
    batch = pa.RecordBatch.from_pylist([{"input_ids": [5, -6, 7], "labels": [1, 1, 1]}, {"input_ids": [], "labels": []}], schema=store_schema(True))
    size, sha256 = write_record_batch(store / "documents-00000.arrow", batch)
    edit_json(store / "store.json", lambda raw: raw["shards"][0].update(bytes=size, sha256=sha256))
    _build_fails(store, FormatError, r"documents-00000.arrow: row 0, column 'input_ids': -6")


def test_a_build_is_not_a_store_and_a_store_not_a_build(store, tmp_path):
    corpus = write_corpus(tmp_path / "ids.parquet", corpus_table([[1, 2, 3]]))
    build(corpus, tmp_path / "packed", max_len=4)
    with pytest.raises(FormatError, match="is a prepack build, not a document store"):
        open_store(tmp_path / "packed")
    with pytest.raises(FormatError, match="is a prepack document store .*, not a build"):
        read_manifest(store)
    # Neither replaces the other, even with overwrite.
    with pytest.raises(OutputError, match=r"is a prepack document store \(store.json\), not a build"):
        build(corpus, store, max_len=4, overwrite=True)
    with pytest.raises(OutputError, match="is a prepack build, not a document store"):
        build_store(corpus, tmp_path / "packed", overwrite=True)
    # A store is no corpus to tokenize, its shards no corpus files, and it is not tokenized again.
    with pytest.raises(InputError, match="is a document store already"):
        build_store(store, tmp_path / "store2")
    with pytest.raises(InputError, match="a shard of a prepack document store"):
        build(store / "documents-00000.arrow", tmp_path / "p2", max_len=4)
    with pytest.raises(InputError, match="tokenized already: leave out --tokenizer"):
        build(store, tmp_path / "p3", max_len=4, tokenizer=tmp_path)
    with pytest.raises(InputError, match="tokenized already: leave out --column, --num-proc"):
        build(store, tmp_path / "p3", max_len=4, column="ids", num_proc=2)
    with pytest.raises(InputError, match="must not lie inside each other"):
        build(store, store / "packed", max_len=4)


def test_overwrite_replaces_a_store_and_leaves_nothing_behind(store, tmp_path):
    before = set(tmp_path.iterdir())
    corpus = write_corpus(tmp_path / "ids.parquet", corpus_table([[1, 2, 3]]))
    assert build_store(corpus, store, overwrite=True).documents == 1
    assert set(tmp_path.iterdir()) == before | {corpus}
    assert sorted(p.name for p in store.iterdir()) == ["documents-00000.arrow", "store.json"]


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["build", "{store}", "--out", "{tmp}/p", "--max-len", "8"], "documents-00001.arrow: its sha256"),
        (["inspect", "{store}"], "is a prepack document store"),
        (["tokenize", "{tmp}/packed", "--out", "{tmp}/s"], "a shard of the prepack build"),
        (["verify", "{tmp}/packed", "--source", "{store}", "--all"], "documents-00001.arrow: its sha256"),
    ],
)
@pytest.mark.slow
def test_the_cli_exits_2_naming_the_problem(store, tmp_path, command, message):
    build(write_corpus(tmp_path / "ids.parquet", corpus_table([[1, 2, 3]])), tmp_path / "packed", max_len=4)
    path = store / "documents-00001.arrow"
    path.write_bytes(path.read_bytes()[:-1] + b"\x01")
    args = [a.format(store=store, tmp=tmp_path) for a in command]
    result = invoke_prepack(*args, env=WIDE)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
