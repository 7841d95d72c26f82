"""The `prepack` command as a user runs it: the console script installed beside this Python, in a
subprocess, and the message of a command it refuses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

PREPACK = shutil.which("prepack", path=str(Path(sys.executable).parent))


def run_prepack(
    *args, env: dict[str, str | None] | None = None, timeout: int = 300, preexec_fn=None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run `prepack ARGS...` (in `cwd`, default this process's) and capture its output as text. `env`
    changes this process's environment as it is at the call (so the variables a fixture set, the S3
    server's, reach the command): a value sets a variable, None removes it."""
    assert PREPACK, "the prepack console script is not installed beside this Python"
    environment = None
    if env is not None:
        environment = {name: value for name, value in {**os.environ, **env}.items() if value is not None}
    return subprocess.run(
        [PREPACK, *map(str, args)],
        capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn, env=environment, cwd=cwd,
    )


WIDE = {"COLUMNS": "1000"}  # rich wraps long paths at the terminal's width; this keeps a message on one line


def failure(result: subprocess.CompletedProcess) -> str:
    """The one-line error of a refused command (exit 2, no traceback), its console wrapping undone."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return " ".join(result.stderr.split())

