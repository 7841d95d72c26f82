"""`--engine ray`: builds and stores written by Ray tasks are byte for byte the local engine's, on a
local Ray instance of one or two CPUs and on a simulated two-node cluster, also when a worker is
killed mid-build; a bad row on a worker is the local engine's error, and nothing is published."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from prepack import build, build_store  # noqa: E402
from prepack.errors import EngineError, FormatError, InputError, MissingExtraError, OutputError  # noqa: E402
from tests.cli import WIDE, failure, invoke_prepack, run_prepack, running, stopped_by_sigterm  # noqa: E402
from tests.corpus import corpus_table, files, random_token_corpus, write_corpus  # noqa: E402
from tests.demo_inputs import CHATML, as_chat, chitchat, gpt2_directory  # noqa: E402

# One worker runs every test of this module, one after another (`--dist loadgroup`): each starts Ray instances that
# take the machine's cores (num_cpus), and one test stops the Ray processes it started.
pytestmark = pytest.mark.xdist_group("ray")

# "local": an instance of this test run, never another run's cluster that ray_current_cluster names.
QUIET_RAY = {"address": "local", "include_dashboard": False, "log_to_driver": False, "logging_level": logging.ERROR}


def _same(a: Path, b: Path) -> int:
    """Assert two outputs have the same files, byte for byte; return how many."""
    left, right = files(a), files(b)
    assert sorted(left) == sorted(right)
    for name in left:
        assert left[name] == right[name], name
    return len(left)


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    return gpt2_directory(tmp_path_factory.mktemp("tok") / "gpt2", CHATML)


@pytest.fixture(scope="module")
def local_ray(request):
    """One Ray instance for the module's tests, the object-storage ones too: started after the session's S3
    server where there is one, so that its workers inherit the AWS variables that point clients at it."""
    with contextlib.suppress(pytest.skip.Exception):  # without moto or s3fs the S3 tests skip, the rest run
        request.getfixturevalue("s3_server")
    ray.init(num_cpus=2, **QUIET_RAY)
    yield
    ray.shutdown()


def _token_corpus(directory: Path) -> Path:
    """Labelled token ids in six files of three formats, empty documents among them, and between
    them a file without rows and one of empty documents only (units of no token)."""
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 1000, rng.integers(0, 400)).tolist() for _ in range(2000)]
    labels = [[-100, *doc[1:]] if doc else [] for doc in documents]
    directory.mkdir()
    for part, name in enumerate(["0.parquet", "1.jsonl", "3.arrow", "5.parquet"]):
        rows = slice(part * 500, (part + 1) * 500)
        write_corpus(directory / name, corpus_table(documents[rows], labels[rows]))
    write_corpus(directory / "2.parquet", corpus_table([], []))
    write_corpus(directory / "4.parquet", corpus_table([[], []], [[], []]))
    return directory


def _conversations(directory: Path, mode: str, parts: int, per_part: int) -> Path:
    """Chitchat conversations as text or chat, in `parts` Parquet files."""
    conversations = chitchat()
    directory.mkdir()
    for part in range(parts):
        rows = conversations[part * per_part : (part + 1) * per_part]
        column = {"text": ["\n".join(t) for t in rows]} if mode == "text" else {"messages": [as_chat(t) for t in rows]}
        pq.write_table(pa.table(column), directory / f"{part}.parquet")
    return directory


@pytest.mark.slow
def test_a_token_corpus_builds_and_stores_the_same_bytes(tmp_path, local_ray):
    corpus = _token_corpus(tmp_path / "c")
    options = {"max_len": 512, "shard_size": 60_000, "algorithm": "bfd", "seed": 2, "drop_untrained": True, "max_docs_per_pack": 3}
    local = build(corpus, tmp_path / "local", **options)
    on_ray = build(corpus, tmp_path / "ray", engine="ray", **options)
    assert on_ray == local and len(local.shards) > 3 and local.totals.empty > 0
    assert _same(tmp_path / "local", tmp_path / "ray") == len(local.shards) + 1
    # Store shards cut by token capacity; at 1,000 bytes most documents overfill a shard alone.
    for shard_size in (1_000, 30_000):
        store = build_store(corpus, tmp_path / f"store-local-{shard_size}", shard_size=shard_size)
        assert build_store(corpus, tmp_path / "store-ray", shard_size=shard_size, engine="ray") == store
        assert len(store.shards) > 3
        _same(tmp_path / f"store-local-{shard_size}", tmp_path / "store-ray")
        if shard_size == 1_000:
            shutil.rmtree(tmp_path / "store-ray")
    # A store is read on Ray too, a task per store shard; its build is the corpus's.
    build(tmp_path / "store-ray", tmp_path / "from-store", engine="ray", **options)
    _same(tmp_path / "local", tmp_path / "from-store")
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("mode", ["text", "chat"])
@pytest.mark.slow
def test_a_tokenized_corpus_builds_and_stores_the_same_bytes(tmp_path, local_ray, gpt2, mode):
    corpus = _conversations(tmp_path / "c", mode, parts=3, per_part=200)
    reading = {"tokenizer": gpt2, "chat": mode == "chat"}
    local = build(corpus, tmp_path / "local", max_len=1024, shard_size=2**17, num_proc=1, **reading)
    on_ray = build(corpus, tmp_path / "ray", max_len=1024, shard_size=2**17, engine="ray", **reading)
    assert on_ray == local and len(local.shards) > 1 and local.has_labels == (mode == "chat")
    _same(tmp_path / "local", tmp_path / "ray")
    build_store(corpus, tmp_path / "store-local", shard_size=2**16, **reading)
    build_store(corpus, tmp_path / "store-ray", shard_size=2**16, engine="ray", **reading)
    assert _same(tmp_path / "store-local", tmp_path / "store-ray") > 3


@pytest.mark.slow
def test_preference_pairs_build_the_same_bytes(tmp_path, local_ray, gpt2):
    """Pairs read and tokenized by a task per file, their prompt lengths gathered on the driver in corpus order."""
    turns = [t for t in chitchat() if len(t) >= 2 and len(t[0]) < 50][:90]  # prompts short enough to cut around
    corpus = tmp_path / "pairs"
    corpus.mkdir()
    for part in range(3):
        rows = turns[part * 30 : (part + 1) * 30]
        lines = [json.dumps({"prompt": f"Q: {t[0]} A:", "chosen": f" {t[1]}", "rejected": " no idea"}) for t in rows]
        (corpus / f"{part}.jsonl").write_text("\n".join(lines) + "\n")
    options = {"max_len": 40, "tokenizer": gpt2, "pairs": True, "overflow": "truncate", "shard_size": 4_000, "seed": 1}
    local = build(corpus, tmp_path / "local", num_proc=1, **options)
    on_ray = build(corpus, tmp_path / "ray", engine="ray", **options)
    assert on_ray == local and len(local.shards) > 1 and local.pairs.truncated > 0
    _same(tmp_path / "local", tmp_path / "ray")


@pytest.mark.slow
def test_a_pair_store_is_stored_and_built_the_same_bytes(tmp_path, local_ray, gpt2):
    """A pair corpus tokenized into a store by Ray tasks (shards cut at pair boundaries) is the local engine's
    store, and a build of it on Ray, each task reading a store shard and its pairs' prompt lengths, the local
    build's, which is the build of the corpus itself."""
    turns = [t for t in chitchat() if len(t) >= 2 and len(t[0]) < 50][:60]
    corpus = tmp_path / "pairs"
    corpus.mkdir()
    for part in range(2):
        rows = turns[part * 30 : (part + 1) * 30]
        lines = [json.dumps({"prompt": f"Q: {t[0]} A:", "chosen": f" {t[1]}", "rejected": " no idea"}) for t in rows]
        (corpus / f"{part}.jsonl").write_text("\n".join(lines) + "\n")
    build_store(corpus, tmp_path / "store", tokenizer=gpt2, pairs=True, shard_size=1_000, num_proc=1)
    build_store(corpus, tmp_path / "store-ray", tokenizer=gpt2, pairs=True, shard_size=1_000, engine="ray")
    assert _same(tmp_path / "store", tmp_path / "store-ray") > 3
    options = {"max_len": 40, "overflow": "truncate", "shard_size": 4_000, "seed": 1}
    local = build(tmp_path / "store", tmp_path / "local", **options)
    on_ray = build(tmp_path / "store", tmp_path / "ray", engine="ray", **options)
    assert on_ray == local and len(local.shards) > 1 and local.pairs.truncated > 0
    _same(tmp_path / "local", tmp_path / "ray")
    build(corpus, tmp_path / "from-corpus", tokenizer=gpt2, pairs=True, num_proc=1, **options)
    _same(tmp_path / "local", tmp_path / "from-corpus")


def _group_rows(turns: list, size: int) -> list[str]:
    """JSONL lines of groups: a prompt, `size` completions (its answer, then others), scores and ranks a completion."""
    others = [" no idea", " perhaps so", " ask again", " never"]
    return [json.dumps({"prompt": f"Q: {t[0]} A:", "completions": [f" {t[1]}", *others[: size - 1]],
                        "scores": [float(k) for k in range(size, 0, -1)], "ranks": [1, *[2] * (size - 1)]})
            for t in turns]


@pytest.mark.slow
def test_groups_are_stored_appended_and_built_the_same_bytes(tmp_path, local_ray, gpt2):
    """Groups of 3 on the Ray engine: tokenized into a store (shards cut at group boundaries), the store grown by
    an append, its full and index builds, and a build of the corpus with scores and ranks, each the local
    engine's bytes; a task reads its file with the driver's group size (the corpus's first row's), so a file of
    no row is read as the local engine reads it, and a later file of other groups is its error."""
    turns = [t for t in chitchat() if len(t) >= 2 and len(t[0]) < 50][:80]
    corpus, new = tmp_path / "groups", tmp_path / "new"
    corpus.mkdir(), new.mkdir()
    (corpus / "0.jsonl").write_text("\n".join(_group_rows(turns[:30], 3)) + "\n")
    (corpus / "1.jsonl").write_text("")  # a file of no group
    (corpus / "2.jsonl").write_text("\n".join(_group_rows(turns[30:60], 3)) + "\n")
    (new / "3.jsonl").write_text("\n".join(_group_rows(turns[60:], 3)) + "\n")
    options = {"max_len": 64, "overflow": "truncate", "shard_size": 4_000, "seed": 1}
    reading = {"tokenizer": gpt2, "groups": True}
    for engine in ("local", "ray"):
        root, cores = tmp_path / engine, {"num_proc": 1} if engine == "local" else {}
        build_store(corpus, root / "store", shard_size=1_000, engine=engine, **reading, **cores)
        build_store(new, root / "store", shard_size=1_000, append=True, engine=engine, **reading, **cores)
        built = build(root / "store", root / "full", engine=engine, **options)
        assert built.pairs.pairs == 80 and built.pairs.truncated > 0 and len(built.shards) > 1
        build(root / "store", root / "index", index_only=True, engine=engine, **options)
        build(corpus, root / "scored", scores_column="scores", ranks_column="ranks", engine=engine, **reading, **cores, **options)
    for output in ("store", "full", "index", "scored"):
        assert _same(tmp_path / "local" / output, tmp_path / "ray" / output) >= 2, output
    both = tmp_path / "both"
    both.mkdir()
    for part in (corpus, new):
        for path in part.iterdir():
            shutil.copy(path, both / path.name)
    build(both, tmp_path / "from-corpus", num_proc=1, **reading, **options)
    shards = lambda build: {name: data for name, data in files(build).items() if name != "manifest.json"}  # noqa: E731
    assert shards(tmp_path / "ray" / "full") == shards(tmp_path / "from-corpus")  # a grown store's fingerprint is chained
    (corpus / "2.jsonl").write_text("\n".join(_group_rows(turns[30:60], 4)) + "\n")
    refusals = []
    for engine, cores in (("local", {"num_proc": 1}), ("ray", {})):
        with pytest.raises(InputError) as refused:
            build_store(corpus, tmp_path / f"bad-{engine}", engine=engine, **reading, **cores)
        refusals.append(str(refused.value))
    assert refusals[0] == refusals[1] and "2.jsonl, row 0" in refusals[0] and "expected a list of 3 completions" in refusals[0]
    assert not any((tmp_path / f"bad-{engine}").exists() for engine in ("local", "ray"))


@pytest.mark.slow
def test_a_mixture_builds_the_same_bytes(tmp_path, local_ray):
    """Two corpora (files of three formats, one without labels) and a store, mixed with a cut at a piece and
    copies, in tokens and in trained tokens: a task per file or store shard reads each pass; a file changed
    or grown between the passes is refused by its second read as on the local engine, a deleted one by
    name, a store put in the place of one by its changed shards."""
    corpus = _token_corpus(tmp_path / "labelled")
    plain = tmp_path / "plain"
    plain.mkdir()
    rng = np.random.default_rng(3)
    for part in range(2):
        write_corpus(plain / f"{part}.parquet", corpus_table([rng.integers(0, 900, rng.integers(1, 1500)).tolist() for _ in range(40)]))
    build_store(plain, tmp_path / "plain-store", shard_size=20_000)
    for count in ("tokens", "trained"):
        mixture = tmp_path / f"mix-{count}.yaml"
        mixture.write_text(
            f"tokens: 150000\nseed: 4\ncount: {count}\nsources:\n  - {{name: a, path: labelled, weight: 0.5}}\n"
            "  - {name: b, path: plain, epochs: 1.5}\n  - {name: c, path: plain-store, weight: 0.2}\n"
        )
        options = {"max_len": 256, "shard_size": 40_000, "seed": 2}
        local = build(mixture, tmp_path / f"local-{count}", **options)
        on_ray = build(mixture, tmp_path / f"ray-{count}", engine="ray", **options)
        assert on_ray == local and len(local.shards) > 2
        assert local.mixture.sources[1].full_epochs >= 1 and local.mixture.sources[2].partial_documents > 0
        _same(tmp_path / f"local-{count}", tmp_path / f"ray-{count}")
    from prepack.building.engines.ray import RayEngine

    read_lengths = RayEngine.read_lengths
    original = pq.read_table(plain / "1.parquet").column("input_ids").to_pylist()
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(plain / "0.parquet", other / "0.parquet")
    write_corpus(other / "1.parquet", corpus_table([[t + 1 for t in d] for d in original]))  # the same lengths, other tokens
    build_store(other, tmp_path / "other-store", shard_size=20_000)

    def replace_the_store():
        (tmp_path / "plain-store").rename(tmp_path / "plain-store-was")
        (tmp_path / "other-store").rename(tmp_path / "plain-store")

    changes = [  # made once every source's first pass is done (the store's is the last)
        (lambda: shutil.copy(other / "1.parquet", plain / "1.parquet"), InputError, "1.parquet: read a second time, the corpus gives other documents"),
        (lambda: write_corpus(plain / "1.parquet", corpus_table([*original, [5, 6, 7]])), InputError, "1.parquet: read a second time, the corpus gives other documents"),
        (lambda: (plain / "1.parquet").unlink(), InputError, r"1.parquet: cannot be read"),  # the last file: read, not dropped
        (replace_the_store, FormatError, r"plain-store/documents-\d+\.arrow: its sha256 is not the store manifest's: the shard changed"),
    ]
    for number, (change, error, message) in enumerate(changes):

        def then_changed(self, documents, reading, progress, observe=None, change=change):
            read = read_lengths(self, documents, reading, progress, observe)
            if documents.store is not None:
                change()
            return read

        write_corpus(plain / "1.parquet", corpus_table(original))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(RayEngine, "read_lengths", then_changed)
            with pytest.raises(error, match=message):
                build(tmp_path / "mix-tokens.yaml", tmp_path / f"changed-{number}", engine="ray", max_len=256)
        assert not (tmp_path / f"changed-{number}").exists() and _leftovers(tmp_path) == []


def _image_chat(directory: Path, images_of_row=lambda row: [row % 3]):
    """A processor and an image-chat corpus of 40 rows prepared here (`prepare_image_chat`: its image set written
    once, locally): row r shows the photographs `images_of_row(r)` (numbers into PHOTOS)."""
    from prepack.sources.images import prepare_image_chat
    from tests.vision_inputs import PHOTOS, SAMPLE_DATA, processor_directory

    processor = processor_directory(directory / "processor")
    (directory / "p").mkdir()
    for name in PHOTOS:
        (directory / "p" / name).write_bytes((SAMPLE_DATA / name).read_bytes())
    records = [
        {"messages": [{"role": "user", "content": [*({"type": "image", "image": f"p/{PHOTOS[photo]}"} for photo in images_of_row(row)),
                                                   {"type": "text", "text": f"what is {row}?"}]},
                      {"role": "assistant", "content": "a photo " * (row % 5 + 1)}]}
        for row in range(40)
    ]
    (directory / "chats.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return processor, prepare_image_chat(directory / "chats.jsonl", processor, directory / "prepared")


@pytest.mark.slow
def test_an_image_chat_corpus_builds_the_same_bytes_and_serves_its_images(tmp_path, local_ray):
    """An image-chat corpus built by tasks, tokenized with the processor's placeholders as on the local engine."""
    from prepack.training.vision_dataset import ImagePackedDataset

    processor, prepared = _image_chat(tmp_path)
    options = {"tokenizer": processor, "chat": True, "max_len": 4096, "shard_size": 40_000}
    local = build(prepared.corpus, tmp_path / "local", num_proc=1, **options)
    on_ray = build(prepared.corpus, tmp_path / "ray", engine="ray", **options)
    assert on_ray == local and local.totals.tokens > 40 * prepared.image_tokens // prepared.references
    _same(tmp_path / "local", tmp_path / "ray")
    served = ImagePackedDataset(tmp_path / "ray", prepared.image_set)
    assert sum(len(served[i]["images"]) for i in range(len(served))) == 40


@pytest.mark.slow
def test_an_image_capped_build_is_the_local_engines_and_a_row_over_the_cap_is_refused(tmp_path, local_ray):
    """--max-images-per-pack on Ray: the driver plans with the image set's counts as the local engine does (the
    same bytes, the cap binding), and a row with more images than the cap is the local engine's refusal by file
    and row, with nothing published."""
    from prepack.formats.images import read_image_set
    from prepack.training.dataset import PackedDataset

    processor, prepared = _image_chat(tmp_path, lambda row: [row % 3] * (1 + (row % 4 == 0)) + [2] * (row % 7 == 0))
    per_row = read_image_set(prepared.image_set).row_images()
    assert per_row.max() == 3
    options = {"tokenizer": processor, "chat": True, "max_len": 4096, "shard_size": 40_000, "images": prepared.image_set}
    local = build(prepared.corpus, tmp_path / "local", num_proc=1, max_images_per_pack=4, **options)
    on_ray = build(prepared.corpus, tmp_path / "ray", engine="ray", max_images_per_pack=4, **options)
    assert on_ray == local
    _same(tmp_path / "local", tmp_path / "ray")
    packs = PackedDataset(tmp_path / "ray")
    assert max(int(per_row[packs.source_rows(i)].sum()) for i in range(len(packs))) == 4  # the cap binds
    with pytest.raises(InputError, match="row 0: 3 images") as local_error:
        build(prepared.corpus, tmp_path / "local-refused", num_proc=1, max_images_per_pack=2, **options)
    with pytest.raises(InputError, match="row 0: 3 images") as ray_error:
        build(prepared.corpus, tmp_path / "ray-refused", engine="ray", max_images_per_pack=2, **options)
    assert str(ray_error.value) == str(local_error.value) and "more than --max-images-per-pack 2" in str(ray_error.value)
    assert not (tmp_path / "ray-refused").exists() and _leftovers(tmp_path) == []


@pytest.mark.slow
def test_workers_serving_a_second_build_read_the_tokenizer_files_as_they_are_now(tmp_path, local_ray, gpt2):
    corpus = _conversations(tmp_path / "c", "text", parts=2, per_part=50)
    tokenizer = Path(shutil.copytree(gpt2, tmp_path / "tok"))
    first = build(corpus, tmp_path / "first", max_len=512, tokenizer=tokenizer, engine="ray")
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config | {"eos_token": "<|im_end|>"}))
    local = build(corpus, tmp_path / "local", max_len=512, tokenizer=tokenizer)
    second = build(corpus, tmp_path / "second", max_len=512, tokenizer=tokenizer, engine="ray")
    assert second == local and second.fingerprint != first.fingerprint
    _same(tmp_path / "local", tmp_path / "second")


def test_a_bad_row_on_a_worker_is_the_local_error_and_nothing_is_published(tmp_path, local_ray, gpt2):
    corpus = _conversations(tmp_path / "c", "text", parts=3, per_part=100)
    bad = [{"text": "fine"}] * 40 + [{"text": 7}] + [{"text": "fine"}] * 10
    (corpus / "3.jsonl").write_text("".join(json.dumps(row) + "\n" for row in bad))
    with pytest.raises(InputError) as local:
        build(corpus, tmp_path / "local", max_len=256, tokenizer=gpt2)
    assert "3.jsonl, row 40, column 'text'" in str(local.value)
    for run in (
        lambda: build(corpus, tmp_path / "ray", max_len=256, tokenizer=gpt2, engine="ray"),
        lambda: build_store(corpus, tmp_path / "ray", tokenizer=gpt2, engine="ray"),
    ):
        with pytest.raises(InputError) as on_ray:
            run()
        assert str(on_ray.value) == str(local.value)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no output, no staging, no lock


def test_a_changed_store_shard_is_the_local_format_error(tmp_path, local_ray):
    corpus = _token_corpus(tmp_path / "c")
    build_store(corpus, tmp_path / "store", shard_size=30_000)
    shard = tmp_path / "store" / "documents-00002.arrow"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 1  # same size: the driver's checks pass, the worker's sha256 does not
    shard.write_bytes(bytes(data))
    with pytest.raises(FormatError) as local:
        build(tmp_path / "store", tmp_path / "local", max_len=512)
    with pytest.raises(FormatError) as on_ray:
        build(tmp_path / "store", tmp_path / "ray", max_len=512, engine="ray")
    assert str(on_ray.value) == str(local.value) and "documents-00002.arrow" in str(local.value)
    assert on_ray.value.problem == local.value.problem is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "store"]


def test_options_the_engine_would_ignore_are_refused_before_anything_runs(tmp_path):
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2, 3]]))
    for options, message in (
        ({"engine": "spark"}, "unknown engine 'spark'"),
        ({"ray_address": "auto"}, "--ray-address joins a Ray cluster: use it with --engine ray"),
        ({"engine": "ray", "num_proc": 2}, "--num-proc sets the local engine's"),
    ):
        with pytest.raises(InputError, match=message):
            build(corpus, tmp_path / "out", max_len=8, **options)
    with pytest.raises(InputError, match="unknown engine"):
        build_store(corpus, tmp_path / "out", engine="dask")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.parquet"]


def test_without_ray_the_engine_says_what_to_install(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2, 3]]))
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as when it is not installed
    monkeypatch.delitem(sys.modules, "prepack.building.engines.ray", raising=False)
    with pytest.raises(MissingExtraError, match=r"pip install 'prepack-llm\[ray\]'"):
        build(corpus, tmp_path / "out", max_len=8, engine="ray")


@pytest.mark.slow
def test_the_cli_builds_on_a_local_ray_instance_and_exits_2_on_a_bad_row(tmp_path):
    corpus = _token_corpus(tmp_path / "c")
    local = invoke_prepack("tokenize", corpus, "--out", tmp_path / "local", "--shard-size", "40kB", "-q")  # the reference
    assert local.returncode == 0, local.stderr
    # No --ray-address: a Ray instance of its own, started and shut down by the command.
    on_ray = run_prepack("tokenize", corpus, "--out", tmp_path / "ray", "--shard-size", "40kB", "--engine", "ray")
    assert on_ray.returncode == 0, on_ray.stderr
    assert "stored 2,002 documents" in " ".join(on_ray.stdout.split())
    _same(tmp_path / "local", tmp_path / "ray")
    write_corpus(corpus / "6.jsonl", corpus_table([[1, 2], [3, -4]], [[-100, 2], [-100, 4]]))
    failed = run_prepack("build", corpus, "--out", tmp_path / "bad", "--engine", "ray", "-q")
    assert failed.returncode == 2
    assert "6.jsonl, row 1, column 'input_ids': token id -4 is out of range" in " ".join(failed.stderr.split())
    assert "Traceback" not in failed.stderr
    assert not (tmp_path / "bad").exists() and _leftovers(tmp_path) == []


# Object storage: corpora, stores and builds at s3:// URIs (the moto server of tests/s3server.py), read
# and written by the workers themselves; the module's Ray instance is started after the server (`local_ray`),
# so that its workers inherit the AWS variables that point clients at it, as any deployment configures them.


@pytest.fixture
def fs(s3_server):
    return pytest.importorskip("s3fs").S3FileSystem()


def _objects(fs, uri: str) -> dict[str, bytes]:
    """Every object under `uri` (a bucket or a prefix), by name relative to it."""
    fs.invalidate_cache()
    prefix = uri.removeprefix("s3://").rstrip("/")
    return {os.path.relpath(key, prefix): fs.cat_file(key) for key in fs.find(prefix)}


def _put(fs, local: Path, uri: str) -> str:
    for path in sorted(local.rglob("*")):
        if path.is_file():
            fs.pipe_file(f"{uri.removeprefix('s3://')}/{path.relative_to(local).as_posix()}", path.read_bytes())
    return uri


def _text_corpus(directory: Path) -> Path:
    directory.mkdir()
    conversations = chitchat()[:600]
    for part in range(3):
        rows = conversations[part * 200 : (part + 1) * 200]
        pq.write_table(pa.table({"text": ["\n".join(t) for t in rows]}), directory / f"{part}.parquet")
    return directory


@pytest.mark.slow
def test_the_cli_builds_text_in_s3_into_s3_as_the_local_engine_and_the_loader_trains_from_it(tmp_path, fs, s3_bucket, gpt2):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from prepack import PackedCollator, PackedDataset, enable_packing
    from tests.tiny_models import tiny_model

    corpus = _put(fs, _text_corpus(tmp_path / "text"), f"{s3_bucket}/corpus")
    options = ["--tokenizer", str(gpt2), "--max-len", "8192", "--shard-size", "100kB", "-q"]
    local = invoke_prepack("build", tmp_path / "text", *options, "--out", tmp_path / "packed")  # the reference
    assert local.returncode == 0, local.stderr
    # The command of issue 14's "done when": its own Ray instance, which inherits this environment.
    on_ray = run_prepack("build", f"{corpus}/", *options, "--out", f"{s3_bucket}/packed", "--engine", "ray")
    assert on_ray.returncode == 0, on_ray.stderr
    built = _objects(fs, f"{s3_bucket}/packed")
    assert len(built) > 3 and built == files(tmp_path / "packed")
    assert {name.split("/")[0] for name in _objects(fs, s3_bucket)} == {"corpus", "packed"}  # no scratch left
    # The loader feeds the model the same batch from S3 (through the cache) as from the local build, so a step
    # trains alike; one step is taken, on the batch from S3 (a step on 2 x 8,192 tokens is most of this test's time).
    local, batch = (next(iter(DataLoader(source, batch_size=2, collate_fn=PackedCollator.for_dataset(source))))
                    for source in (PackedDataset(tmp_path / "packed"), PackedDataset(f"{s3_bucket}/packed", cache_dir=tmp_path / "cache")))
    assert batch.keys() == local.keys()
    for key, value in local.items():
        assert torch.equal(batch[key], value) if isinstance(value, torch.Tensor) else batch[key] == value, key
    torch.manual_seed(0)
    model = enable_packing(tiny_model("llama", "sdpa", torch.float32))
    vocab = model.config.vocab_size  # the tiny model's, smaller than GPT-2's: ids folded into it
    batch["input_ids"] %= vocab
    batch["labels"] = torch.where(batch["labels"] == -100, -100, batch["labels"] % vocab)
    loss = model(**batch).loss
    loss.backward()
    before = next(model.parameters()).detach().clone()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert np.isfinite(loss.item()) and not torch.equal(next(model.parameters()), before)
    # A bad row in S3 on Ray (its URI named, no object left) is the library test's below; exit 2 on a bad row from the
    # command on Ray, test_the_cli_builds_on_a_local_ray_instance_and_exits_2_on_a_bad_row's.


@pytest.mark.slow
def test_a_store_tokenized_into_s3_and_builds_from_it_equal_the_local_engine(tmp_path, local_ray, fs, s3_bucket, gpt2):
    text = _text_corpus(tmp_path / "text")
    corpus = _put(fs, text, f"{s3_bucket}/corpus")
    build_store(text, tmp_path / "store", tokenizer=gpt2, shard_size=150_000)
    build_store(corpus, f"{s3_bucket}/store", tokenizer=gpt2, shard_size=150_000, engine="ray")
    stored = _objects(fs, f"{s3_bucket}/store")
    assert len(stored) > 3 and stored == files(tmp_path / "store")
    options = dict(max_len=1024, shard_size=200_000, seed=1)
    local = build(tmp_path / "store", tmp_path / "packed", **options)
    assert build(f"{s3_bucket}/store", f"{s3_bucket}/packed", engine="ray", **options) == local
    # One side in object storage, the other local: the same bytes too.
    build(f"{s3_bucket}/store", tmp_path / "from-s3", engine="ray", **options)
    build(tmp_path / "store", f"{s3_bucket}/to-s3", engine="ray", **options)
    expected = files(tmp_path / "packed")
    assert _objects(fs, f"{s3_bucket}/packed") == _objects(fs, f"{s3_bucket}/to-s3") == expected
    assert files(tmp_path / "from-s3") == expected
    # Overwritten only with overwrite, as locally.
    with pytest.raises(OutputError, match="already exists"):
        build(f"{s3_bucket}/store", f"{s3_bucket}/packed", engine="ray", **options)
    fewer = {**options, "shard_size": 600_000}  # fewer shards: the replaced build's others are deleted
    build(tmp_path / "store", tmp_path / "fewer", **fewer)
    build(f"{s3_bucket}/store", f"{s3_bucket}/packed", engine="ray", overwrite=True, **fewer)
    assert _objects(fs, f"{s3_bucket}/packed") == files(tmp_path / "fewer")
    assert len(expected) > len(_objects(fs, f"{s3_bucket}/packed"))
    assert {name.split("/")[0] for name in _objects(fs, s3_bucket)} == {"corpus", "store", "packed", "to-s3"}


@pytest.mark.slow
def test_labelled_tokens_with_empty_documents_and_files_in_s3_build_and_store_the_local_bytes(tmp_path, local_ray, fs, s3_bucket):
    corpus = _token_corpus(tmp_path / "c")
    remote = _put(fs, corpus, f"{s3_bucket}/corpus")
    options = dict(max_len=256, shard_size=300_000, seed=2, algorithm="bfd")
    build(corpus, tmp_path / "packed", **options)
    build(remote, f"{s3_bucket}/packed", engine="ray", **options)
    build_store(corpus, tmp_path / "store", shard_size=300_000)
    build_store(remote, f"{s3_bucket}/store", shard_size=300_000, engine="ray")
    for name in ("packed", "store"):
        expected = files(tmp_path / name)
        assert len(expected) > 3 and _objects(fs, f"{s3_bucket}/{name}") == expected, name
    assert {key.split("/")[0] for key in _objects(fs, s3_bucket)} == {"corpus", "packed", "store"}


@pytest.mark.slow
def test_a_mixture_of_sources_in_s3_builds_into_s3_the_local_bytes(tmp_path, local_ray, fs, s3_bucket):
    """Its scratch objects (each file's first read deleted once hashed, then the selected documents') under the
    build's scratch prefix, which is gone when the build is."""
    corpus = _token_corpus(tmp_path / "c")
    _put(fs, corpus, f"{s3_bucket}/corpus")
    build_store(corpus, tmp_path / "store", shard_size=300_000)
    _put(fs, tmp_path / "store", f"{s3_bucket}/store")
    text = "tokens: 120000\nseed: 1\nsources:\n  - {{name: a, path: {a}, weight: 0.7}}\n  - {{name: b, path: {b}, weight: 0.3}}\n"
    (tmp_path / "local.yaml").write_text(text.format(a="c", b="store"))
    (tmp_path / "remote.yaml").write_text(text.format(a=f"{s3_bucket}/corpus", b=f"{s3_bucket}/store"))
    options = dict(max_len=256, shard_size=150_000, seed=2)
    local = build(tmp_path / "local.yaml", tmp_path / "packed", **options)
    on_ray = build(tmp_path / "remote.yaml", f"{s3_bucket}/packed", engine="ray", **options)
    assert [s.tokens for s in on_ray.mixture.sources] == [s.tokens for s in local.mixture.sources]
    expected = files(tmp_path / "packed")
    expected.pop("manifest.json")  # the sources' paths differ: the rest is the local build's
    found = _objects(fs, f"{s3_bucket}/packed")
    assert len(expected) > 3 and {name: found[name] for name in expected} == expected
    assert sorted(found) == sorted([*expected, "manifest.json"])
    assert {key.split("/")[0] for key in _objects(fs, s3_bucket)} == {"corpus", "store", "packed"}


@pytest.mark.slow
def test_a_bad_row_in_a_later_object_is_the_local_error_and_leaves_no_object(tmp_path, local_ray, fs, s3_bucket):
    corpus = _token_corpus(tmp_path / "c")
    write_corpus(corpus / "6.jsonl", corpus_table([[1, 2], [3, -4]], [[-100, 2], [-100, 4]]))
    remote = _put(fs, corpus, f"{s3_bucket}/corpus")
    with pytest.raises(InputError) as local:
        build(remote, f"{s3_bucket}/local", max_len=512)
    with pytest.raises(InputError) as on_ray:
        build(remote, f"{s3_bucket}/ray", max_len=512, shard_size=20_000, engine="ray")
    assert str(on_ray.value) == str(local.value)
    assert f"{remote}/6.jsonl, row 1, column 'input_ids'" in str(local.value)
    assert list(_objects(fs, s3_bucket)) == [f"corpus/{n}" for n in sorted(_objects(fs, remote))]


@pytest.mark.slow
def test_a_damaged_store_shard_in_s3_is_named_by_its_uri_on_a_worker(tmp_path, local_ray, fs, s3_bucket):
    build_store(_token_corpus(tmp_path / "c"), tmp_path / "store", shard_size=300_000)
    name = json.loads((tmp_path / "store" / "store.json").read_text())["shards"][2]["name"]
    data = bytearray((tmp_path / "store" / name).read_bytes())
    data[-100] ^= 0xFF
    (tmp_path / "store" / name).write_bytes(bytes(data))
    store = _put(fs, tmp_path / "store", f"{s3_bucket}/store")
    with pytest.raises(FormatError) as local:
        build(store, f"{s3_bucket}/local", max_len=512)
    with pytest.raises(FormatError) as on_ray:
        build(store, f"{s3_bucket}/ray", max_len=512, engine="ray")
    assert str(on_ray.value) == str(local.value) == f"{store}/{name}: its sha256 is not the store manifest's: the shard changed."
    assert {key.split("/")[0] for key in _objects(fs, s3_bucket)} == {"store"}


def test_the_scratch_prefix_is_beside_the_output_and_only_it_is_deleted(s3_server, fs, s3_bucket):
    from prepack.storage.remote import Publication, scratch_prefix

    kept = {".packed.prepack-scratch-other/x": b"1", "packed-2/y": b"2", "packedz/z": b"3"}
    for name, data in kept.items():
        fs.pipe_file(f"{s3_bucket.removeprefix('s3://')}/{name}", data)
    publication = Publication(f"{s3_bucket}/packed/", False, "manifest.json")
    for failing in (False, True):
        with pytest.raises(RuntimeError) if failing else contextlib.nullcontext():
            with scratch_prefix(publication) as scratch:
                assert scratch.startswith(f"{s3_bucket}/.packed.prepack-scratch-")
                fs.pipe_file(f"{scratch.removeprefix('s3://')}/deep/ids-00000.bin", b"tokens")
                assert len(_objects(fs, s3_bucket)) == len(kept) + 2  # and the staging marker
                if failing:
                    raise RuntimeError("a build failed")
        assert set(_objects(fs, s3_bucket)) == {*kept, ".packed.prepack-staging"}
    publication.discard()
    assert _objects(fs, s3_bucket) == kept


def test_a_failed_publication_deletes_what_its_workers_uploaded_and_nothing_else(tmp_path, s3_server, fs, s3_bucket):
    """The rules the Ray engine's shard tasks upload by (`Publication`), at a prefix holding a build
    that this one replaces: the old manifest goes before the first new shard, and a failure deletes
    the new shards recorded and the unpublished build's others (no prefix is left with shards and no
    manifest), not anything beside the prefix."""
    from prepack.storage.remote import Publication

    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1] * 50] * 40))
    build(corpus, f"{s3_bucket}/packed", max_len=64, shard_size=1_000)
    fs.pipe_file(f"{s3_bucket.removeprefix('s3://')}/packed-2/keep", b"k")
    old = _objects(fs, s3_bucket)
    assert {"packed/manifest.json", "packed/shard-00000.arrow", "packed/shard-00001.arrow"} <= set(old)
    publication = Publication(f"{s3_bucket}/packed", True, "manifest.json")
    publication.uploading(["shard-00000.arrow"])
    assert "packed/manifest.json" not in _objects(fs, s3_bucket)  # unpublished before a shard goes up
    fs.pipe_file(publication.shard_uri("shard-00000.arrow").removeprefix("s3://"), b"a new shard")
    publication.discard()
    assert _objects(fs, s3_bucket) == {k: v for k, v in old.items() if not k.startswith("packed/")}


def test_an_index_build_runs_on_the_driver_with_the_local_bytes(tmp_path, local_ray):
    build_store(_token_corpus(tmp_path / "c"), tmp_path / "store", shard_size=40_000)
    local = build(tmp_path / "store", tmp_path / "local", max_len=512, index_only=True)
    assert build(tmp_path / "store", tmp_path / "ray", max_len=512, index_only=True, engine="ray") == local
    assert _same(tmp_path / "local", tmp_path / "ray") >= 2


@pytest.mark.slow
def test_appends_to_a_store_and_to_its_builds_write_the_local_bytes(tmp_path, local_ray):
    """`--append` on the Ray engine: a store grown by a corpus, then its full and index builds grown by the
    documents added, every shard numbered on from the output's, byte for byte as the local engine grows them."""
    rng = np.random.default_rng(7)
    for part, count in (("old", 900), ("new", 300)):
        documents = [rng.integers(0, 1000, rng.integers(0, 300)).tolist() for _ in range(count)]
        (tmp_path / part).mkdir()
        write_corpus(tmp_path / part / f"{part}.parquet", corpus_table(documents, [[-100, *d[1:]] if d else [] for d in documents]))
    for engine in ("local", "ray"):
        root = tmp_path / engine
        build_store(tmp_path / "old", root / "store", shard_size=30_000, engine=engine)
        build(root / "store", root / "full", max_len=512, shard_size=40_000, engine=engine)
        build(root / "store", root / "index", max_len=512, index_only=True, engine=engine)
        build_store(tmp_path / "new", root / "store", shard_size=30_000, append=True, engine=engine)
        grown = build(root / "store", root / "full", max_len=512, shard_size=40_000, append=True, engine=engine)
        build(root / "store", root / "index", max_len=512, index_only=True, append=True, engine=engine)
        assert len(grown.generations) == 2 and grown.generations[0].shards < len(grown.shards)
    # Not "index": every index build runs on the LocalEngine (`build._engine`), with --engine ray too; its
    # append is accepted here, and tests/building/test_append.py checks what it writes.
    for output in ("store", "full"):
        assert _same(tmp_path / "local" / output, tmp_path / "ray" / output) >= 3, output


@pytest.mark.slow
def test_appends_in_s3_on_the_ray_engine_write_the_local_bytes(tmp_path, local_ray, fs, s3_bucket):
    """The object-storage append (new shard objects first, the manifest last on its ETag) on Ray tasks:
    a store and its full build grown in S3, object for object the local engine's appends."""
    rng = np.random.default_rng(8)
    for part, count in (("old", 600), ("new", 200)):
        documents = [rng.integers(0, 1000, rng.integers(0, 300)).tolist() for _ in range(count)]
        (tmp_path / part).mkdir()
        write_corpus(tmp_path / part / f"{part}.parquet", corpus_table(documents, [[-100, *d[1:]] if d else [] for d in documents]))
    for root, engine in ((tmp_path / "local", "local"), (f"{s3_bucket}/grown", "ray")):
        build_store(tmp_path / "old", f"{root}/store", shard_size=120_000, engine=engine)
        build(f"{root}/store", f"{root}/full", max_len=512, shard_size=160_000, engine=engine)
        build_store(tmp_path / "new", f"{root}/store", shard_size=120_000, append=True, engine=engine)
        build(f"{root}/store", f"{root}/full", max_len=512, shard_size=160_000, append=True, engine=engine)
    for output in ("store", "full"):
        expected = files(tmp_path / "local" / output)
        assert len(expected) >= 3 and _objects(fs, f"{s3_bucket}/grown/{output}") == expected, output


@pytest.mark.slow
def test_a_task_that_fails_or_whose_worker_dies_is_an_engine_error_of_one_line(local_ray):
    from prepack.building.engines.ray import _result

    @ray.remote
    def raises():
        raise ValueError("not prepack's\nsecond line")

    @ray.remote(max_retries=0)
    def dies():
        os._exit(1)

    with pytest.raises(EngineError) as failed:
        _result(raises.remote())
    assert str(failed.value) == "a Ray task of this build failed: ValueError: not prepack's"
    with pytest.raises(EngineError, match=r"^the Ray cluster lost a task of this build: \w+Error") as lost:
        _result(dies.remote())
    assert "\n" not in str(lost.value)


@pytest.fixture
def no_ray_instance():
    """This process connected to no Ray instance (the module's is shut down): a build checks the address it is
    given and joins the cluster there, as a process of its own would."""
    ray.shutdown()


def _closed_port() -> int:
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("address", ["127.0.0.1:-1", "127.0.0.1:http", "127.0.0.1:70000", "ray://:10001", "garbage", ""])
def test_an_address_that_cannot_parse_is_refused_at_once_and_exit_2(address, tmp_path):
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2, 3]]))
    started = time.monotonic()
    with pytest.raises(InputError, match=f"^--ray-address {address}: not a Ray address"):
        build(corpus, tmp_path / "out", max_len=8, engine="ray", ray_address=address)
    assert time.monotonic() - started < 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.parquet"]


@pytest.mark.slow
def test_an_address_that_cannot_parse_exits_2_from_the_option_and_from_ray_address(tmp_path):
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2, 3]]))
    command = ["build", corpus, "--max-len", "8", "--out", tmp_path / "out", "--engine", "ray"]
    for args, env in (([*command, "--ray-address", "127.0.0.1:-1"], None), (command, {"RAY_ADDRESS": "host:port"})):
        result = run_prepack(*args, env=env, timeout=60)
        assert result.returncode == 2 and "not a Ray address" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.parquet"]


@pytest.mark.slow
def test_an_address_where_something_but_not_ray_listens_is_an_engine_error_in_seconds(tmp_path, no_ray_instance):
    """An HTTP server where the cluster should be: Ray would retry for minutes, prepack asks it the
    HTTP/2 preface that Ray's gRPC servers answer, and gives up at once."""
    import http.server

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2, 3]]))
    try:
        result = run_prepack("build", corpus, "--max-len", "8", "--out", tmp_path / "out", "--engine", "ray", "--ray-address", address, timeout=60)
        assert result.returncode == 2 and "something answers there, but not a Ray cluster" in " ".join(result.stderr.split()), result.stderr
        with pytest.raises(EngineError, match=f"^--ray-address ray://{address}: something answers there, but not a Ray cluster"):
            build(corpus, tmp_path / "out", max_len=8, engine="ray", ray_address=f"ray://{address}")
    finally:
        server.shutdown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.parquet"]


@pytest.mark.slow
def test_a_ray_clusters_gcs_passes_the_address_check(no_ray_instance):
    from prepack.building.engines.ray import _check_listening

    ray.init(num_cpus=1, **QUIET_RAY)
    try:
        _check_listening(ray.get_runtime_context().gcs_address, "the test's Ray")  # raises if it does not answer as gRPC
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_an_address_where_nothing_listens_is_an_engine_error_and_exit_2(tmp_path, no_ray_instance):
    port = _closed_port()
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2, 3]]))
    with pytest.raises(EngineError, match=f"--ray-address 127.0.0.1:{port}: no Ray cluster answers there"):
        build(corpus, tmp_path / "out", max_len=8, engine="ray", ray_address=f"127.0.0.1:{port}")
    result = run_prepack(
        "build", corpus, "--max-len", "8", "--out", tmp_path / "out", "--engine", "ray", "--ray-address", f"ray://127.0.0.1:{port}", timeout=120
    )
    assert result.returncode == 2 and "no Ray cluster answers there" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.parquet"]


@pytest.mark.slow
def test_without_an_address_the_command_starts_its_own_instance_not_the_machines_last_cluster(tmp_path):
    """`ray.init()` alone joins the cluster named by RAY_TMPDIR's `ray/ray_current_cluster` (written by
    `ray start` and by a test's `ray.cluster_utils.Cluster`), whose workers may run in another
    environment; without --ray-address a build joins only the cluster that RAY_ADDRESS names."""
    port = _closed_port()
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths lie under it
    try:
        (ray_tmp / "ray").mkdir()
        (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}")
        environment = {"RAY_ADDRESS": None, "RAY_TMPDIR": str(ray_tmp)}
        corpus = _token_corpus(tmp_path / "c")
        build(corpus, tmp_path / "local", max_len=512, shard_size=40_000)
        command = ["build", corpus, "--max-len", "512", "--shard-size", "40kB", "--engine", "ray", "-q"]
        own = run_prepack(*command, "--out", tmp_path / "ray", env=environment)
        assert own.returncode == 0, own.stderr
        assert _same(tmp_path / "local", tmp_path / "ray") > 3
        asked = run_prepack(*command, "--out", tmp_path / "asked", env=environment | {"RAY_ADDRESS": f"127.0.0.1:{port}"}, timeout=120)
        assert f"RAY_ADDRESS 127.0.0.1:{port}: no Ray cluster answers there" in failure(asked)
        assert not (tmp_path / "asked").exists()
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _reading_on_ray(prepack: psutil.Process, out: Path) -> bool:
    """Whether the build to `out` runs its tasks: a scratch file is in its staging directory."""
    return any(out.parent.glob(f".{out.name}.tmp-*/scratch/ids-*"))


@pytest.mark.slow
def test_a_build_stopped_by_sigterm_shuts_down_the_ray_instance_it_started(tmp_path):
    """SIGTERM while the tasks run: exit 143, nothing published or left beside --out, no process of
    the local Ray instance the command started (GCS, raylet, agents, workers) still running, and no
    task's temporary directory left in TMPDIR (the tasks running are cancelled and awaited first)."""
    corpus = tmp_path / "c"
    corpus.mkdir()
    for part in range(4):
        random_token_corpus(corpus / f"{part}.parquet", 50_000, seed=part)
    out = tmp_path / "built" / "out"
    out.parent.mkdir()
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths lie under it
    try:
        stopped, started = stopped_by_sigterm(
            "build", corpus, "--max-len", "1024", "--out", out, "--engine", "ray", "-q",
            ready=functools.partial(_reading_on_ray, out=out),
            env={"RAY_ADDRESS": None, "RAY_TMPDIR": str(ray_tmp), "TMPDIR": str(ray_tmp), **WIDE},
        )
        assert stopped.returncode == 143, stopped.stderr
        assert len(stopped.stderr.splitlines()) == 1 and "SIGTERM" in stopped.stderr, stopped.stderr
        assert not out.exists() and _leftovers(out.parent) == []
        assert any("raylet" in command for command in started.values()), started
        assert running(started, within=10) == []
        assert [path.name for path in ray_tmp.iterdir()] == ["ray"]  # Ray's session logs, and nothing of prepack's
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


LIBRARY_RAY_BUILD = """
import signal, sys
import ray
from prepack import build

def callers(signum, frame):
    pass

signal.signal(signal.SIGTERM, callers)
build(sys.argv[1], sys.argv[2], max_len=512, engine="ray")
print(signal.getsignal(signal.SIGTERM) is callers, ray.is_initialized())
"""


@pytest.mark.slow
def test_a_library_build_on_its_own_ray_instance_leaves_the_callers_sigterm_handler(tmp_path):
    """`ray.init` replaces the SIGTERM handler (and Ray leaves its own after `ray.shutdown`): a build that
    starts a Ray instance puts the caller's back (in a process of its own, as this test's Ray is not)."""
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2, 3], [4, 5]]))
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths lie under it
    try:
        environment = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
        result = subprocess.run(
            [sys.executable, "-c", LIBRARY_RAY_BUILD, str(corpus), str(tmp_path / "out")],
            capture_output=True, text=True, timeout=300, env=environment | {"RAY_TMPDIR": str(ray_tmp)},
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


# Ray instances of another shape: each test below starts its own, after the module's is shut down.


@pytest.fixture
def one_cpu_ray(local_ray):
    ray.shutdown()
    ray.init(num_cpus=1, **QUIET_RAY)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_one_worker_writes_the_same_bytes(tmp_path, one_cpu_ray, gpt2):
    corpus = _conversations(tmp_path / "c", "chat", parts=3, per_part=150)
    build(corpus, tmp_path / "local", max_len=512, shard_size=2**16, tokenizer=gpt2, chat=True)
    build(corpus, tmp_path / "ray", max_len=512, shard_size=2**16, tokenizer=gpt2, chat=True, engine="ray")
    assert _same(tmp_path / "local", tmp_path / "ray") > 3


@pytest.fixture(scope="module")
def two_nodes():
    """A simulated cluster: a head node and a second node, one CPU each, on this machine."""
    from ray.cluster_utils import Cluster

    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.ERROR)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


_TASKS = ("ray::_read_unit", "ray::_write_pack_shard", "ray::_write_store_shard")


def _watch_tasks(stop: threading.Event, parents: set[int], kill: str | None = None, killed: list[int] | None = None) -> None:
    """Until `stop`: note the parent process (the node's raylet) of every worker process of this test's
    Ray that runs one of the engine's tasks (Ray titles a worker `ray::NAME` while it runs task NAME),
    and SIGKILL the first that runs task `kill`."""
    while not stop.is_set():
        for process in psutil.Process().children(recursive=True):
            try:
                title, parent = " ".join(process.cmdline()), process.ppid()
            except psutil.Error:
                continue
            if title.startswith(_TASKS):
                parents.add(parent)
            if kill is not None and not killed and title.startswith(f"ray::{kill}"):
                os.kill(process.pid, signal.SIGKILL)
                killed.append(process.pid)
        time.sleep(0.005)


def _watched_build(corpus: Path, out: Path, kill: str | None = None, **options) -> tuple[set[int], list[int]]:
    parents, killed, stop = set(), [], threading.Event()
    watcher = threading.Thread(target=_watch_tasks, args=(stop, parents, kill, killed))
    watcher.start()
    try:
        build(corpus, out, engine="ray", **options)
    finally:
        stop.set()
        watcher.join()
    return parents, killed


@pytest.mark.slow
def test_a_two_node_cluster_writes_the_same_bytes_with_a_worker_killed(tmp_path, two_nodes, gpt2):
    assert len([node for node in ray.nodes() if node["Alive"]]) == 2
    corpus = _conversations(tmp_path / "c", "text", parts=4, per_part=500)
    options = {"tokenizer": gpt2, "max_len": 2048, "shard_size": 2**18}
    build(corpus, tmp_path / "local", **options)
    raylets, _ = _watched_build(corpus, tmp_path / "ray", **options)
    assert len(raylets) == 2, "the tasks did not run on both nodes"
    _same(tmp_path / "local", tmp_path / "ray")
    for task in ("_read_unit", "_write_pack_shard"):
        _, killed = _watched_build(corpus, tmp_path / f"killed-{task}", kill=task, **options)
        assert len(killed) == 1, f"no {task} task was seen running"
        _same(tmp_path / "local", tmp_path / f"killed-{task}")
