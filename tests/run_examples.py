"""Run examples/ scripts one after another from this one process, each as `python SCRIPT ARGS...` runs it: as
`__main__`, its directory first on sys.path, `sys.argv` its command line, in a working directory of its own, and
its file descriptors 1 and 2 (print, logging, warnings and C libraries alike) written to files of its own. torch,
transformers, TRL and prepack's training wing are imported once, here; each script then runs in a child forked from
this process (before any of them ran), so it starts from those imports alone and never from what an earlier script
left (`tests/project/test_examples.py` reads what each left).

    python tests/run_examples.py PLAN.json

PLAN.json is a list of {"argv": [SCRIPT, ARGS...], "cwd": DIR, "stdout": FILE, "stderr": FILE, "status": FILE};
each script's exit status is written to its "status" file as Python's own would be: 0, SystemExit's code, or 1
(SystemExit with a message, which goes to stderr as Python writes it, or an exception, whose traceback does), or
-N where a signal N ended it (-9: killed after RUN_SECONDS). The runs share the environment the runner started with
(one HF_HOME: huggingface_hub reads it when imported, before the first fork).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

RUN_SECONDS = 600  # each run's limit, as each example's own process had (pyproject.toml's pytest-timeout)


def run_script(argv: list[str]) -> int:
    """Run argv[0] as `python argv[0] argv[1:]` would; its exit status."""
    script = Path(argv[0]).resolve()
    sys.argv = [str(script), *argv[1:]]
    sys.path[0] = str(script.parent)  # where Python puts the script's directory (not this runner's, tests/)
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - Python's own last resort: the traceback on stderr, exit status 1
        traceback.print_exc()
        return 1
    return 0


def _imported_once() -> None:
    """What the examples import, and what takes seconds to import: done before the first fork, shared by every child."""
    import torch  # noqa: F401
    import transformers
    import trl  # noqa: F401

    import prepack.training.dataset  # noqa: F401
    import prepack.training.preference  # noqa: F401
    import prepack.training.reference  # noqa: F401

    for name in ("AutoModelForCausalLM", "AutoTokenizer", "Trainer", "TrainingArguments"):  # lazy until first use
        getattr(transformers, name)
    for name in ("SFTTrainer", "DPOTrainer", "KTOTrainer"):
        getattr(trl, name)


def _run_in_child(run: dict) -> int:
    """Fork; the child runs the script with its own cwd, stdout and stderr and exits as Python does after a script
    (atexit handlers, non-daemon threads joined, its status); one that runs past `RUN_SECONDS` is killed (-9)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: leaves main() by SystemExit, or by os._exit where it could not start the script
        try:
            stdout, stderr = open(run["stdout"], "wb"), open(run["stderr"], "wb")
            os.dup2(stdout.fileno(), 1)
            os.dup2(stderr.fileno(), 2)
            os.chdir(run["cwd"])
        except BaseException:  # noqa: BLE001
            os._exit(1)
        raise SystemExit(run_script(run["argv"]))
    deadline = time.monotonic() + RUN_SECONDS
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            done = os.waitpid(pid, 0)
            break
        time.sleep(0.2)
    return os.waitstatus_to_exitcode(done[1])


def main() -> None:
    _imported_once()
    for run in json.loads(Path(sys.argv[1]).read_text(encoding="utf-8")):
        Path(run["status"]).write_text(str(_run_in_child(run)), encoding="utf-8")


if __name__ == "__main__":
    main()
