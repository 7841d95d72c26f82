"""The `prepack` command as a user runs it: the console script installed beside this Python, in a
subprocess (or the same command in this process), the message of a command it refuses, and a command stopped by
SIGTERM."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

PREPACK = shutil.which("prepack", path=str(Path(sys.executable).parent))


def run_prepack(
    *args, env: dict[str, str | None] | None = None, timeout: int = 300, preexec_fn=None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run `prepack ARGS...` (in `cwd`, default this process's) and capture its output as text. `env`
    changes this process's environment as it is at the call (so the variables a fixture set, the S3
    server's, reach the command): a value sets a variable, None removes it. Messages are not wrapped (`WIDE`)
    unless `env` names COLUMNS: a test's paths are as long as its temporary directory (longer under xdist)."""
    assert PREPACK, "the prepack console script is not installed beside this Python"
    given = {**os.environ, **WIDE, **(env or {})}
    environment = {name: value for name, value in given.items() if value is not None}
    return subprocess.run(
        [PREPACK, *map(str, args)],
        capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn, env=environment, cwd=cwd,
    )


WIDE = {"COLUMNS": "1000"}  # rich wraps long paths at the terminal's width; this keeps a message on one line


def invoke_prepack(
    *args, env: dict[str, str | None] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`run_prepack` in this process (typer's CliRunner): the same exit code, standard output and error, without
    the seconds a new Python spends importing (more for commands that import pyarrow, matplotlib, torch). For the
    calls a process proves nothing more by: each command family keeps tests that run the console script. An
    exception the command lets through (a traceback in a process) is raised here, failing the test with it."""
    from typer.testing import CliRunner

    from prepack.cli import app

    with contextlib.chdir(cwd or Path.cwd()):
        result = CliRunner().invoke(app, list(map(str, args)), env={**WIDE, **(env or {})})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["prepack", *map(str, args)], result.exit_code, result.stdout, result.stderr)


def failure(result: subprocess.CompletedProcess) -> str:
    """The one-line error of a refused command (exit 2, no traceback), its console wrapping undone."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return " ".join(result.stderr.split())


def stopped_by_sigterm(
    *args, ready: Callable[[psutil.Process], bool], env: dict[str, str | None], timeout: float = 300
) -> tuple[subprocess.CompletedProcess, dict[psutil.Process, str]]:
    """Start `prepack ARGS...` with the environment `env` changes as `run_prepack`'s does, wait until
    `ready(process)` holds, and send it SIGTERM, as `kill`, `timeout` and job schedulers stop a command.
    Its result, and the processes it had started (children and theirs) when stopped, with their command lines."""
    assert PREPACK, "the prepack console script is not installed beside this Python"
    command = [PREPACK, *map(str, args)]
    environment = {name: value for name, value in {**os.environ, **env}.items() if value is not None}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
    try:
        prepack = psutil.Process(process.pid)
        deadline = time.monotonic() + timeout
        while not ready(prepack):
            assert process.poll() is None, ("it ended before it was stopped", process.returncode, process.stderr.read())
            assert time.monotonic() < deadline, "never ready to be stopped"
            time.sleep(0.02)
        started = {}
        for child in prepack.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                started[child] = " ".join(child.cmdline())
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), started


def running(processes: Iterable[psutil.Process], within: float = 0) -> list[psutil.Process]:
    """Those of `processes` that still run (neither ended nor ended and waiting to be reaped), at once
    or, when some do, after waiting up to `within` seconds for them to end."""
    processes, deadline = list(processes), time.monotonic() + within
    while True:
        alive = []
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)
