"""A job launched as several processes whose ranks would not train as one is refused by `PackedSampler`
with DistributedSetupError, before its first index: no process group at the first iteration, or (a real
torchrun of two processes on CPU) an `Accelerator()` that initialised the group, reports one process
and so wraps no model in DDP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prepack.errors import DistributedSetupError, PrepackError
from prepack.training.sampler import PackedSampler

ROOT = Path(__file__).resolve().parents[2]


def test_several_processes_without_a_process_group_at_the_first_iteration_are_refused(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    sampler = PackedSampler(50)  # built where nothing says this process is one of several
    monkeypatch.setenv("WORLD_SIZE", "2")  # ... and iterated where the launcher says so, with no group
    with pytest.raises(DistributedSetupError, match="init_process_group .* or pass rank= and world_size="):
        iter(sampler)
    with pytest.raises(DistributedSetupError, match="WORLD_SIZE"):
        PackedSampler(50)
    assert isinstance(DistributedSetupError("x"), PrepackError)
    assert len(list(PackedSampler(50, rank=1, world_size=2))) == 25  # explicit ranks: the caller's choice


@pytest.mark.parametrize("given", [{}, {"rank": 1}, {"world_size": 2}])
def test_a_sampler_built_under_a_launcher_without_a_process_group_is_refused_at_construction(monkeypatch, given):
    """torchrun's variables, no init_process_group: whatever rank= or world_size= is left to default would be
    rank 0 or world size 1 on every process, so the sampler is refused when built, naming what is missing."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    missing = [name for name in ("rank", "world_size") if name not in given]
    with pytest.raises(DistributedSetupError, match=f"one of 2 .*RANK 1.*no {' or '.join(f'{m}=' for m in missing)} given"):
        PackedSampler(50, **given)
    assert len(list(PackedSampler(50, rank=1, world_size=2))) == 25  # both explicit: the caller's choice


def test_an_accelerator_with_fewer_processes_than_the_group_is_refused(monkeypatch):
    """One process standing for rank 0 of a group of two, as `Accelerator()` leaves it on a machine
    without GPUs (the real two-process run is below)."""
    from accelerate.state import PartialState

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    sampler = PackedSampler(50)
    monkeypatch.setattr(PartialState, "_shared_state", {"num_processes": 1})
    with pytest.raises(DistributedSetupError, match="Accelerate set up 1 process over this process group"):
        iter(sampler)
    monkeypatch.setattr(PartialState, "_shared_state", {"num_processes": 2})
    assert len(list(sampler)) == 25


LAUNCHED = """
import json, os, sys
from accelerate import Accelerator
from prepack.errors import DistributedSetupError
from prepack.training.sampler import PackedSampler

accelerator = Accelerator(cpu=sys.argv[2] == "cpu")
sampler = PackedSampler(10, seed=1)
try:
    result = {"packs": list(sampler), "processes": accelerator.num_processes}
except DistributedSetupError as error:
    result = {"refused": str(error), "processes": accelerator.num_processes}
open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w").write(json.dumps(result))
"""


def torchrun_two(tmp_path: Path, mode: str) -> list[dict]:
    out = tmp_path / mode
    out.mkdir()
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               str(script), str(out), mode]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
def test_torchrun_with_an_accelerator_that_set_up_no_ddp_is_refused_and_with_cpu_true_deals_halves(tmp_path):
    refused = torchrun_two(tmp_path, "default")
    for rank in refused:
        assert rank["processes"] == 1  # Accelerate's view: one process, no DDP
        assert "Accelerator(cpu=True)" in rank["refused"], rank
    dealt = torchrun_two(tmp_path, "cpu")
    assert [rank["processes"] for rank in dealt] == [2, 2]
    assert sorted(dealt[0]["packs"] + dealt[1]["packs"]) == list(range(10))
