"""The output directory: published exclusively and atomically, never replacing or deleting what
prepack did not write, and every environment failure (full disk, file-size limit, a parent that is not
a directory) an OutputError with exit 2 and nothing left behind."""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from prepack import build
from prepack.cli import app
from prepack.errors import InputError, OutputError
from prepack.formats.shards import MANIFEST_NAME
from prepack.storage.output import replaceable_build
from tests.cli import WIDE, run_prepack, running, stopped_by_sigterm
from tests.corpus import corpus_table, files, random_token_corpus, write_corpus
from tests.demo_inputs import CHATML, as_chat, chitchat, gpt2_directory

build_module = importlib.import_module("prepack.building.build")
output_module = importlib.import_module("prepack.storage.output")


@pytest.fixture(params=["plain rename", *(["renameat2"] if output_module._renameat2 is not None else [])])
def renames(request, monkeypatch):
    """Publishing with Linux's renameat2 flags, and as on file systems and systems without them."""
    if request.param == "plain rename":
        monkeypatch.setattr(output_module, "_renameat2", None)


def corpus(tmp_path, documents=((1, 2), (3,))):
    return write_corpus(tmp_path / "c.parquet", corpus_table([list(d) for d in documents]))


def siblings(out):
    """What a build to `out` may leave beside it: its lock and staging directories."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def during_the_build(monkeypatch, action):
    """Run `action` once while the build runs: after the corpus is stored, before anything is published."""
    real, done = build_module.plan_packs, []

    def plan_packs(*args, **kwargs):
        if not done:
            done.append(action)
            action()
        return real(*args, **kwargs)

    monkeypatch.setattr(build_module, "plan_packs", plan_packs)


# Exclusive publishing


def test_a_directory_created_at_out_while_the_build_runs_is_never_replaced(tmp_path, monkeypatch, renames):
    out = tmp_path / "out"

    def user_creates_out():
        out.mkdir()
        (out / "thesis.tex").write_text("years of work")

    during_the_build(monkeypatch, user_creates_out)
    with pytest.raises(OutputError, match="appeared"):
        build(corpus(tmp_path), out, max_len=4)
    assert files(out) == {"thesis.tex": b"years of work"}
    assert siblings(out) == []


def test_with_overwrite_a_build_changed_while_the_build_runs_is_never_replaced(tmp_path, monkeypatch, renames):
    out = tmp_path / "out"
    build(corpus(tmp_path), out, max_len=4)
    during_the_build(monkeypatch, lambda: (out / "notes.txt").write_text("mine"))
    with pytest.raises(OutputError, match="changed while this build ran.*notes.txt"):
        build(corpus(tmp_path), out, max_len=4, overwrite=True, seed=1)
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / MANIFEST_NAME).read_text())["options"]["seed"] == 0
    assert siblings(out) == []


def test_with_overwrite_a_build_swapped_for_another_while_the_build_runs_is_never_replaced(tmp_path, monkeypatch, renames):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    build(corpus(tmp_path), out, max_len=4)
    build(corpus(tmp_path), elsewhere, max_len=4, seed=7)  # a valid build, but not the one decided on

    def swap():
        os.rename(out, tmp_path / "moved")
        os.rename(elsewhere, out)

    during_the_build(monkeypatch, swap)
    with pytest.raises(OutputError, match="changed"):
        build(corpus(tmp_path), out, max_len=4, overwrite=True, seed=1)
    assert json.loads((out / MANIFEST_NAME).read_text())["options"]["seed"] == 7
    assert siblings(out) == []


def test_with_overwrite_a_build_whose_manifest_is_rewritten_in_place_while_the_build_runs_is_never_replaced(tmp_path, monkeypatch, renames):
    """The same directory (device and inode), its manifest.json rewritten in place with another build's: publishing
    tells it from the build found at the start, though it parses a manifest only where the file's bytes changed."""
    out, other = tmp_path / "out", tmp_path / "other"
    build(corpus(tmp_path), out, max_len=4)
    build(corpus(tmp_path), other, max_len=4, seed=7)  # a valid build of shards of the same names
    during_the_build(monkeypatch, lambda: (out / MANIFEST_NAME).write_bytes((other / MANIFEST_NAME).read_bytes()))
    with pytest.raises(OutputError, match="changed while this build ran.*no longer the build"):
        build(corpus(tmp_path), out, max_len=4, overwrite=True, seed=1)
    assert json.loads((out / MANIFEST_NAME).read_text())["options"]["seed"] == 7
    assert siblings(out) == []


def test_a_build_that_replaces_another_parses_the_replaced_manifest_once(tmp_path, monkeypatch):
    """Found under the lock (parsed), found again at publishing and again before it is deleted after the exchange
    (the same bytes each time: not parsed again; its files still checked against it): one parse, not three."""
    out = tmp_path / "out"
    build(corpus(tmp_path), out, max_len=4)
    parsed, read = [], output_module.read_manifest
    monkeypatch.setattr(output_module, "read_manifest", lambda *args, **kwargs: parsed.append(args) or read(*args, **kwargs))
    build(corpus(tmp_path), out, max_len=4, overwrite=True, seed=1)
    assert len(parsed) == 1 and json.loads((out / MANIFEST_NAME).read_text())["options"]["seed"] == 1
    assert siblings(out) == []


def test_a_replaced_build_whose_manifest_changed_just_before_the_exchange_is_kept_not_deleted(tmp_path, monkeypatch):
    """Between the check at publishing and the exchange, the manifest file of `out` is overwritten with something
    that is not a manifest: the build swapped out is read again before anything of it is deleted, so those bytes,
    which prepack did not write, are kept (beside `out`, in the staging directory, which the error names)."""
    out = tmp_path / "out"
    build(corpus(tmp_path), out, max_len=4)
    exchange = output_module._exchange

    def overwritten_then_exchanged(built, target):
        (target / MANIFEST_NAME).write_bytes(b"not a manifest of prepack's")
        exchange(built, target)

    monkeypatch.setattr(output_module, "_exchange", overwritten_then_exchanged)
    with pytest.raises(OutputError, match="not a prepack build"):
        build(corpus(tmp_path), out, max_len=4, overwrite=True, seed=1)
    kept = [path for path in tmp_path.rglob(MANIFEST_NAME) if path.read_bytes() == b"not a manifest of prepack's"]
    assert len(kept) == 1 and kept[0].parent != out


def test_a_second_build_to_the_same_out_fails_while_the_first_runs(tmp_path, monkeypatch):
    out = tmp_path / "out"
    second = []

    def second_build():
        with pytest.raises(OutputError, match="another prepack build") as info:
            build(corpus(tmp_path, [[9]]), out, max_len=4, overwrite=True)
        second.append(str(info.value))

    during_the_build(monkeypatch, second_build)
    first = build(corpus(tmp_path), out, max_len=4)
    assert second and ".out.lock" in second[0]
    assert json.loads((out / MANIFEST_NAME).read_text())["fingerprint"] == first.fingerprint
    assert siblings(out) == []


def test_a_corpus_that_takes_in_an_earlier_build_is_refused(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    # int32 token lists, as in the shards: read as a corpus, they would pass for one more corpus file
    write_corpus(data / "c.arrow", pa.table({"input_ids": pa.array([[1, 2], [3]], pa.list_(pa.int32()))}))
    build(data, data / "packed", max_len=4)
    with pytest.raises(InputError, match="a shard of the prepack build") as info:
        build(data, tmp_path / "again", max_len=4)
    assert "shard-00000.arrow" in str(info.value) and str(data / "packed") in str(info.value)
    assert not (tmp_path / "again").exists() and siblings(tmp_path / "again") == []


# What --overwrite may replace


def write_manifest_of(tmp_path, directory, **changes):
    """A valid prepack manifest written into `directory`, with `changes` to its JSON."""
    build(corpus(tmp_path), tmp_path / "model-build", max_len=4, shard_size=1)
    manifest = json.loads((tmp_path / "model-build" / MANIFEST_NAME).read_text())
    manifest.update(changes)
    directory.mkdir(exist_ok=True)
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    return manifest


def not_a_build(tmp_path, case):
    out = tmp_path / "out"
    out.mkdir()
    if case == "garbage manifest":
        (out / MANIFEST_NAME).write_text("my notes, not JSON")
        return out, "cannot be read as JSON"
    if case == "manifest of another program":
        (out / MANIFEST_NAME).write_text(json.dumps({"name": "my-app", "version": "1.0"}))
        return out, "not a prepack build"
    manifest = write_manifest_of(tmp_path, out)
    for shard in manifest["shards"]:
        (out / shard["name"]).write_bytes(b"shard")
    if case == "a build and a user's file":
        (out / "notes.txt").write_text("mine")
        return out, "notes.txt"
    if case == "a build and a user's directory":
        (out / "checkpoints").mkdir()
        (out / "checkpoints" / "step-1000.pt").write_text("weights")
        return out, "checkpoints"
    if case == "a shard name that leaves the build":
        (tmp_path / "precious.txt").write_text("mine")
        manifest["shards"][0]["name"] = "../precious.txt"
        (out / MANIFEST_NAME).write_text(json.dumps(manifest))
        return out, "precious.txt"
    if case == "a shard that is a directory":
        name = manifest["shards"][0]["name"]
        (out / name).unlink()
        (out / name).mkdir()
        (out / name / "data").write_text("mine")
        return out, name
    if case == "a shard that is a symbolic link":
        name = manifest["shards"][0]["name"]
        (out / name).unlink()
        (tmp_path / "target.bin").write_text("mine")
        (out / name).symlink_to(tmp_path / "target.bin")
        return out, name
    raise ValueError(case)


OTHER_DIRECTORIES = [
    "garbage manifest",
    "manifest of another program",
    "a build and a user's file",
    "a build and a user's directory",
    "a shard name that leaves the build",
    "a shard that is a directory",
    "a shard that is a symbolic link",
]


@pytest.mark.parametrize("case", OTHER_DIRECTORIES)
def test_overwrite_replaces_only_a_directory_that_is_a_prepack_build(tmp_path, case):
    out, message = not_a_build(tmp_path, case)
    data = corpus(tmp_path)
    around = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(OutputError, match="not a prepack build") as info:
        build(data, out, max_len=4, overwrite=True)
    assert message in str(info.value) and str(out) in str(info.value)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == around
    assert siblings(out) == []


@pytest.mark.parametrize("there", ["a user's directory", "a file", "a prepack build"])
def test_an_output_that_never_replaces_refuses_what_is_at_out_without_a_flag_to_pass(tmp_path, there):
    """`overwrite_option=None`: the caller has no way to replace `out`, so the refusal says it exists, whatever is
    there, and suggests no --overwrite."""
    out = tmp_path / "out"
    if there == "a prepack build":
        build(corpus(tmp_path), out, max_len=4)
    elif there == "a file":
        out.write_text("mine")
    else:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    around = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(OutputError, match="already exists") as info:
        with output_module.staged_directory(out, overwrite=False, overwrite_option=None):
            pytest.fail("the block ran")
    assert "--overwrite" not in str(info.value) and "never replaces" in str(info.value)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == around
    assert siblings(out) == []


def test_replaceable_build_accepts_a_build_with_missing_shards_and_an_empty_directory(tmp_path):
    out = tmp_path / "out"
    manifest = build(corpus(tmp_path), out, max_len=4, shard_size=1)
    (out / manifest.shards[0].name).unlink()  # damaged, but nothing in it is foreign
    assert replaceable_build(out) == manifest
    (tmp_path / "empty").mkdir()
    assert replaceable_build(tmp_path / "empty") is None
    assert build(corpus(tmp_path), tmp_path / "empty", max_len=4, overwrite=True).shards


def test_overwrite_replaces_a_build_with_more_shards_and_leaves_nothing_of_it(tmp_path, renames):
    out = tmp_path / "out"
    old = build(corpus(tmp_path, [[1, 2]] * 20), out, max_len=4, shard_size=1)
    new = build(corpus(tmp_path), out, max_len=4, overwrite=True)
    assert len(old.shards) > len(new.shards)
    assert sorted(files(out)) == sorted([MANIFEST_NAME, *(s.name for s in new.shards)])
    assert siblings(out) == []


# --out as a symbolic link


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("target", ["a build", "nothing"])
@pytest.mark.slow
def test_a_symbolic_link_at_out_is_refused_and_left_as_it_is(tmp_path, target, overwrite):
    data = corpus(tmp_path)
    real = tmp_path / "real"
    if target == "a build":
        build(data, real, max_len=4)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    result = run_prepack("build", data, "--max-len", "4", "--out", link, *(["--overwrite"] if overwrite else []), env=WIDE)
    assert result.returncode == 2, result.stderr
    assert "symbolic link" in result.stderr and "Traceback" not in result.stderr
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert siblings(link) == [] and siblings(real) == []


@pytest.mark.parametrize("out", ["loop", "loop/inside"])
def test_a_symbolic_link_loop_at_out_is_an_output_error(tmp_path, out):
    data = corpus(tmp_path)
    (tmp_path / "loop").symlink_to(tmp_path / "other")
    (tmp_path / "other").symlink_to(tmp_path / "loop")
    with pytest.raises(OutputError, match="loop"):
        build(data, tmp_path / out, max_len=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["loop", "other", data.name])


# Killed builds


PAUSED_BUILD = """
import importlib, sys, time

def pause(*args, **kwargs):
    print("paused", flush=True)
    time.sleep(600)

build_module = importlib.import_module("prepack.building.build")
build_module.plan_packs = pause
build_module.build(sys.argv[1], sys.argv[2], max_len=4)
"""


@pytest.mark.slow
def test_a_killed_build_leaves_scratch_that_the_next_build_clears(tmp_path):
    data, out = corpus(tmp_path), tmp_path / "out"
    lookalike = tmp_path / ".out.tmp-0123abcd"  # a user's directory with a staging directory's name
    lookalike.mkdir()
    (lookalike / "notes.txt").write_text("mine")
    paused = subprocess.Popen([sys.executable, "-c", PAUSED_BUILD, str(data), str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert paused.stdout.readline() == "paused\n"
        staging = [name for name in siblings(out) if ".tmp-" in name and name != lookalike.name]
        assert len(staging) == 1

        running = run_prepack("build", data, "--max-len", "4", "--out", out, "--overwrite", env=WIDE)
        assert running.returncode == 2
        assert "another prepack build" in running.stderr and "Traceback" not in running.stderr
        assert staging[0] in siblings(out)  # the running build's scratch is left alone
    finally:
        paused.send_signal(signal.SIGKILL)
        paused.wait()
        paused.stdout.close()
    assert staging[0] in siblings(out)

    assert run_prepack("build", data, "--max-len", "4", "--out", out, "-q", env=WIDE).returncode == 0
    assert siblings(out) == [lookalike.name]
    assert files(lookalike) == {"notes.txt": b"mine"}


# Stopped builds: SIGTERM (what `kill`, `timeout` and job schedulers send) ends a command as an error
# does, with what it wrote deleted and the processes it started stopped; SIGKILL cannot be helped.


def _chat_corpus(path):
    pq.write_table(pa.table({"messages": [as_chat(turns) for turns in chitchat()]}), path)
    return path


def _staging_started(prepack: psutil.Process, out) -> bool:
    return any(".tmp-" in name for name in siblings(out))


def _workers_started(prepack: psutil.Process) -> bool:
    """Whether both tokenizer worker processes of `prepack build --chat --num-proc 2` run (spawned by
    multiprocessing), and with them its staging directory and the pickled encoder in TMPDIR."""
    workers = 0
    for child in prepack.children():
        with contextlib.suppress(psutil.Error):
            workers += "multiprocessing.spawn" in " ".join(child.cmdline())
    return workers == 2


@pytest.mark.slow
@pytest.mark.parametrize("corpus_kind", ["token ids", "chat with tokenizer workers"])
def test_a_build_stopped_by_sigterm_exits_143_and_leaves_nothing(tmp_path, corpus_kind):
    temporary, out = tmp_path / "tmp", tmp_path / "built" / "out"
    temporary.mkdir()
    out.parent.mkdir()
    if corpus_kind == "token ids":
        options = [random_token_corpus(tmp_path / "c.parquet", 100_000)]
        ready = functools.partial(_staging_started, out=out)
    else:
        gpt2 = gpt2_directory(tmp_path / "gpt2", CHATML)
        options = [_chat_corpus(tmp_path / "c.parquet"), "--chat", "--tokenizer", gpt2, "--num-proc", "2"]
        ready = _workers_started
    stopped, started = stopped_by_sigterm(
        "build", *options, "--max-len", "1024", "--out", out, "-q", ready=ready, env={"TMPDIR": str(temporary), **WIDE}
    )
    assert stopped.returncode == 143, stopped.stderr
    assert len(stopped.stderr.splitlines()) == 1 and "SIGTERM" in stopped.stderr, stopped.stderr
    assert not out.exists() and siblings(out) == []
    assert list(temporary.iterdir()) == []
    workers = [process for process, command in started.items() if "multiprocessing.spawn" in command]
    assert len(workers) == (0 if corpus_kind == "token ids" else 2)
    assert running(workers) == []  # stopped and reaped by the command before it exits
    assert running(started, within=5) == []  # multiprocessing's resource tracker ends when its pipe closes


def test_the_command_run_in_process_and_the_library_leave_the_callers_sigterm_handler(tmp_path):
    """Only the command sets a SIGTERM handler, and only while it runs: `app()` called in a process of
    the caller's (a notebook, a test) leaves the caller's."""

    def callers(signum, frame):
        raise AssertionError("not called")

    previous = signal.signal(signal.SIGTERM, callers)
    try:
        result = CliRunner().invoke(app, ["build", str(corpus(tmp_path)), "--max-len", "4", "--out", str(tmp_path / "cli"), "-q"])
        assert result.exit_code == 0, result.output
        assert signal.getsignal(signal.SIGTERM) is callers
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_replaced_build_left_in_stale_scratch_is_deleted_only_by_its_manifest(tmp_path):
    """A build killed after publishing leaves the build it replaced in its staging directory: the next
    build deletes the files its manifest names, and keeps the directory if anything else is in it."""
    data, out = corpus(tmp_path), tmp_path / "out"
    staging = tmp_path / ".out.tmp-0badc0de"
    (staging / "build").mkdir(parents=True)
    (staging / ".prepack-staging").write_text("")
    build(data, tmp_path / "old", max_len=4)
    for name, content in files(tmp_path / "old").items():
        (staging / "build" / name).write_bytes(content)
    (staging / "build" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="notes.txt, which prepack did not write"):
        build(data, out, max_len=4)
    assert (staging / "build" / "notes.txt").read_text() == "mine" and not out.exists()
    (staging / "build" / "notes.txt").unlink()
    build(data, out, max_len=4)
    assert siblings(out) == []


# Environment errors


def file_size_limit(limit):
    """A file-size limit for a child process: writes past it fail with EFBIG (errno 27)."""

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the limit kills the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.parametrize(
    ("failing", "documents", "options", "limit"),
    [
        ("ids.bin", [list(range(1000))] * 10, ["--max-len", "1000"], 2**15),  # 40 kB of scratch
        ("shard-00000.arrow", [list(range(1000))] * 6, ["--max-len", "1000"], 2**15),  # 24 kB of scratch, 36 kB of shard
        # 60 shards of 1.5 kB: a 12 kB manifest (a lower limit than the others', so that few shards are written)
        (MANIFEST_NAME, [[1, 2]] * 60, ["--max-len", "2", "--shard-size", "1"], 2**13),
    ],
)
@pytest.mark.slow
def test_a_file_too_large_for_the_file_system_is_an_output_error_and_leaves_nothing(tmp_path, failing, documents, options, limit):
    data, out = corpus(tmp_path, documents), tmp_path / "out"
    result = run_prepack("build", data, "--out", out, *options, preexec_fn=file_size_limit(limit), env=WIDE)
    assert result.returncode == 2, result.stderr
    message = " ".join(result.stderr.split())
    assert "Traceback" not in message and "File too large" in message and failing in message, message
    assert not out.exists() and siblings(out) == []


def test_a_full_disk_while_syncing_shards_is_an_output_error_and_leaves_nothing(tmp_path, monkeypatch):
    """ENOSPC (errno 28) with no root and no small file system to fill: `fdatasync` is where a full disk
    shows when the data was cached before it met the disk, so it is made to fail there."""

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fdatasync", full)
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="No space left on device") as info:
        build(corpus(tmp_path), out, max_len=4)
    assert "shard-00000.arrow" in str(info.value)
    assert not out.exists() and siblings(out) == []


@pytest.mark.parametrize("out", [".", ".."])
def test_out_that_names_no_directory_is_an_output_error(tmp_path, out, monkeypatch):
    """On main, `--out . --overwrite` in an empty directory tried to rename the working directory."""
    data = corpus(tmp_path)
    (tmp_path / "work" / "here").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work" / "here")
    with pytest.raises(OutputError, match="does not name a directory"):
        build(data, out, max_len=4, overwrite=True)
    assert [p.name for p in (tmp_path / "work").rglob("*")] == ["here"]


@pytest.mark.slow
def test_out_under_a_regular_file_is_an_output_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    result = run_prepack("build", corpus(tmp_path), "--max-len", "4", "--out", tmp_path / "file" / "out", env=WIDE)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and str(tmp_path / "file") in " ".join(result.stderr.split())
    assert (tmp_path / "file").read_text() == "not a directory"



@pytest.mark.parametrize("staging", ["staged_directory", "resumable_staging"])
def test_a_staging_directory_whose_mark_cannot_be_written_is_removed(tmp_path, monkeypatch, staging):
    """A staging directory without prepack's mark is one no later run deletes (`is_staging` needs the
    mark), so a failure writing the mark must take the new directory away with it."""
    real = Path.write_text

    def write_text(path, *args, **kwargs):
        if path.name == output_module.STAGING_MARK:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    out = tmp_path / "out"
    opened = (output_module.staged_directory(out, overwrite=False) if staging == "staged_directory"
              else output_module.resumable_staging(out, lambda build: None))
    with output_module.output_lock(out) if staging == "resumable_staging" else contextlib.nullcontext():
        with pytest.raises(OutputError, match=f"cannot create .*{os.strerror(errno.ENOSPC)}"):
            with opened:
                pass
    assert list(tmp_path.iterdir()) == []


# The command line: every failure a message and exit 2, never a traceback


@pytest.mark.slow
def test_a_build_that_drops_every_document_is_an_input_error(tmp_path):
    result = run_prepack("build", corpus(tmp_path, [[1, 2, 3], [4, 5, 6]]), "--max-len", "2", "--overflow", "drop", "--out", tmp_path / "out", env=WIDE)
    assert result.returncode == 2, result.stderr
    message = " ".join(result.stderr.split())
    assert "Traceback" not in message and "no document is left to pack" in message and "2 are longer than --max-len 2" in message
    assert not (tmp_path / "out").exists() and siblings(tmp_path / "out") == []


def test_check_isolation_without_transformers_names_the_extra_to_install(tmp_path):
    """Also: messages are printed as they are, brackets included (rich took them for markup)."""
    without_transformers = "import sys; sys.modules['transformers'] = None; from prepack.cli import app; app()"
    result = subprocess.run(
        [sys.executable, "-c", without_transformers, "check-isolation", "--model", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "pip install 'prepack-llm[train]'" in " ".join(result.stderr.split())


@pytest.mark.slow
def test_inspect_plot_into_a_missing_directory_is_an_output_error(tmp_path):
    build(corpus(tmp_path), tmp_path / "out", max_len=4)
    result = run_prepack("inspect", tmp_path / "out", "--plot", tmp_path / "missing" / "report.png", env=WIDE)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and f"cannot write {tmp_path / 'missing' / 'report.png'}" in result.stderr


@pytest.mark.parametrize("command", ["inspect", "verify", "check-isolation --model"])
@pytest.mark.slow
def test_every_command_reports_a_prepack_error_with_exit_2(tmp_path, command):
    result = run_prepack(*command.split(), tmp_path / "missing", env=WIDE)
    assert result.returncode == 2
    assert result.stderr.startswith("error:") and "Traceback" not in result.stderr
    assert str(tmp_path / "missing") in " ".join(result.stderr.split())
