"""`--engine ray`: builds and stores written by Ray tasks are byte for byte the local engine's, on a
local Ray instance of one or two CPUs and on a simulated two-node cluster, also when a worker is
killed mid-build; a bad row on a worker is the local engine's error, and nothing is published."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from examples.chitchat import CHATML, as_chat, chitchat, gpt2_directory  # noqa: E402
from prepack import build, build_store  # noqa: E402
from prepack.errors import FormatError, InputError  # noqa: E402
from tests.corpus import corpus_table, write_corpus  # noqa: E402

PREPACK = shutil.which("prepack", path=str(Path(sys.executable).parent))
QUIET_RAY = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.ERROR}


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _same(a: Path, b: Path) -> int:
    """Assert two outputs have the same files, byte for byte; return how many."""
    left, right = _files(a), _files(b)
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
def local_ray():
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


def test_a_token_corpus_builds_and_stores_the_same_bytes(tmp_path, local_ray):
    corpus = _token_corpus(tmp_path / "c")
    options = {"max_len": 512, "shard_size": 60_000, "algorithm": "bfd", "seed": 2, "drop_untrained": True}
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
        ({"engine": "ray", "index_only": True}, "--index-only reads no token"),
    ):
        with pytest.raises(InputError, match=message):
            build(corpus, tmp_path / "out", max_len=8, **options)
    with pytest.raises(InputError, match="unknown engine"):
        build_store(corpus, tmp_path / "out", engine="dask")
    with pytest.raises(InputError, match="object storage is the local engine's for now"):
        build_store(corpus, "s3://bucket/store", engine="ray")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.parquet"]


def test_without_ray_the_engine_says_what_to_install(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "c.parquet", corpus_table([[1, 2, 3]]))
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as when it is not installed
    monkeypatch.delitem(sys.modules, "prepack.engine_ray", raising=False)
    with pytest.raises(InputError, match=r"pip install 'prepack\[ray\]'"):
        build(corpus, tmp_path / "out", max_len=8, engine="ray")


@pytest.mark.slow
def test_the_cli_builds_on_a_local_ray_instance_and_exits_2_on_a_bad_row(tmp_path):
    corpus = _token_corpus(tmp_path / "c")
    local = subprocess.run(
        [PREPACK, "tokenize", str(corpus), "--out", str(tmp_path / "local"), "--shard-size", "40kB", "-q"],
        capture_output=True, text=True, timeout=300,
    )
    assert local.returncode == 0, local.stderr
    # No --ray-address: a Ray instance of its own, started and shut down by the command.
    on_ray = subprocess.run(
        [PREPACK, "tokenize", str(corpus), "--out", str(tmp_path / "ray"), "--shard-size", "40kB", "--engine", "ray"],
        capture_output=True, text=True, timeout=300,
    )
    assert on_ray.returncode == 0, on_ray.stderr
    assert "stored 2,002 documents" in " ".join(on_ray.stdout.split())
    _same(tmp_path / "local", tmp_path / "ray")
    write_corpus(corpus / "6.jsonl", corpus_table([[1, 2], [3, -4]], [[-100, 2], [-100, 4]]))
    failed = subprocess.run(
        [PREPACK, "build", str(corpus), "--out", str(tmp_path / "bad"), "--engine", "ray", "-q"],
        capture_output=True, text=True, timeout=300,
    )
    assert failed.returncode == 2
    assert "6.jsonl, row 1, column 'input_ids': token id -4 is out of range" in " ".join(failed.stderr.split())
    assert "Traceback" not in failed.stderr
    assert not (tmp_path / "bad").exists() and _leftovers(tmp_path) == []


# Ray instances of another shape: each test below starts its own, after the module's is shut down.


@pytest.fixture
def one_cpu_ray(local_ray):
    ray.shutdown()
    ray.init(num_cpus=1, **QUIET_RAY)
    yield
    ray.shutdown()


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
    corpus = _conversations(tmp_path / "c", "text", parts=4, per_part=1500)
    options = {"tokenizer": gpt2, "max_len": 2048, "shard_size": 2**18}
    build(corpus, tmp_path / "local", **options)
    raylets, _ = _watched_build(corpus, tmp_path / "ray", **options)
    assert len(raylets) == 2, "the tasks did not run on both nodes"
    _same(tmp_path / "local", tmp_path / "ray")
    for task in ("_read_unit", "_write_pack_shard"):
        _, killed = _watched_build(corpus, tmp_path / f"killed-{task}", kill=task, **options)
        assert len(killed) == 1, f"no {task} task was seen running"
        _same(tmp_path / "local", tmp_path / f"killed-{task}")
