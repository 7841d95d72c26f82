"""examples/rollouts_grpo_plain.py runs as its docstring says, on one process and on two ranks: every rank computes
the same plans, every first update of a generation has a ratio of exactly 1 (the old log-probabilities, stored with
the rollouts, line up with the update's re-planned and re-collated micro-batches), and its loss is finite."""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rollouts_grpo_plain.py"
SMALL = ["--steps", "2", "--prompts", "2", "--group", "3", "--max-new-tokens", "12"]


def run(command: list[str], tmp_path: Path) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(EXAMPLE.parents[1]), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def steps(stdout: str) -> list[tuple[str, int, float, str | None]]:
    """(step.iteration, sequences, loss, ratio error or None) of every line the example printed for a step."""
    found = re.findall(r"^step (\S+) sequences (\d+) .* loss (\S+)(?: ratio error (\S+))?$", stdout, flags=re.MULTILINE)
    return [(step, int(sequences), float(loss), error or None) for step, sequences, loss, error in found]


def plan_digests(stdout: str) -> dict[str, dict[str, tuple[str, str]]]:
    """{step: {rank: (old plan's digest, update plan's digest)}} of the lines every rank printed."""
    digests = {}
    for rank, step, old, update in re.findall(r"^rank (\d+) step (\d+) plans (\w+) (\w+)$", stdout, flags=re.MULTILINE):
        digests.setdefault(step, {})[rank] = (old, update)
    return digests


@pytest.mark.slow  # sampling and training a tiny model: seconds
def test_the_grpo_example_trains_with_whole_groups_and_an_exact_first_ratio(tmp_path):
    stdout = run([sys.executable, str(EXAMPLE), *SMALL, "--whole-groups", "--iterations", "2"], tmp_path)
    printed = steps(stdout)
    assert [step for step, *_ in printed] == ["1.1", "1.2", "2.1", "2.2"], stdout
    assert all(sequences == 6 for _, sequences, _, _ in printed)
    assert [error for step, _, _, error in printed if step.endswith(".1")] == ["0", "0"]
    assert all(math.isfinite(loss) for _, _, loss, _ in printed)
    assert any(abs(loss) > 1e-6 for step, _, loss, _ in printed if step.endswith(".2"))  # the second update moved
    assert re.search(r"^final loss \S+$", stdout, flags=re.MULTILINE)
    assert [(step, list(ranks)) for step, ranks in plan_digests(stdout).items()] == [("1", ["0"]), ("2", ["0"])]


@pytest.mark.slow  # two processes under torchrun
def test_the_grpo_example_on_two_ranks_plans_the_gathered_rollouts_alike(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # each rank's stdout to its own file: two processes printing to one pipe can interleave within a line
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
                "--log-dir", str(tmp_path / "logs"), "--redirects", "1"]
    run([*torchrun, str(EXAMPLE), "--steps", "1", *SMALL[2:]], tmp_path)
    logs = sorted((tmp_path / "logs").rglob("stdout.log"))
    assert len(logs) == 2, logs
    stdout = "".join(log.read_text() for log in logs)
    printed = steps(stdout)
    assert [(step, sequences, error) for step, sequences, _, error in printed] == [("1.1", 12, "0")], stdout
    digests = plan_digests(stdout)
    assert sorted(digests) == ["1"] and sorted(digests["1"]) == ["0", "1"], stdout
    assert len({digest for pair in digests["1"].values() for digest in pair}) == 1, digests  # one plan, all ranks
