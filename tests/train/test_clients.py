"""Real clients on CPU, two processes each (`tests/clients.py` trains; this checks what it recorded):
every pack is trained on once per epoch across the ranks, a run stopped after a few steps and resumed
trains on exactly the packs an uninterrupted run does, in the same order, and the model gets batches
that keep documents apart without `enable_packing` (use_cache=False, offsets, no attention_mask).
The traps are refused before the first batch: a sampler built before init_process_group, and a
rank-aware sampler in a loader that Accelerate shards again. So an upgrade of torch, torchdata,
transformers, TRL or Accelerate that breaks any of this fails here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from prepack import PackedCollator, PackedDataset, PackedSampler
from tests.clients import Record
from tests.corpus import training_build

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "tests" / "clients.py"
STEPS = 3  # trained before the state is saved
RANKS = 2


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """31 distinct packs of up to 128 tokens."""
    return training_build(tmp_path_factory.mktemp("clients"), documents=120, longest=60, max_len=128)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(client: str, packed: Path, out: Path) -> dict[str, list[dict]]:
    """Run a client in two processes; per phase, what each rank recorded."""
    out.mkdir()
    if client == "accelerate":
        # `accelerate launch --cpu --num_processes 2` runs one process; --multi_gpu with a CPU-only
        # Accelerator(cpu=True) starts two, on gloo.
        launcher = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1"]
        launcher += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
        launcher += ["--num_processes", str(RANKS)]
    else:
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(RANKS), "--master_port", str(free_port())]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(out / "hf"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = [sys.executable, *launcher, str(CLIENTS), client, "--data", str(packed), "--out", str(out)]
    command += ["--steps", str(STEPS)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return {
        phase: [json.loads((out / f"{client}-{phase}-{rank}.json").read_text()) for rank in range(RANKS)]
        for phase in ("epoch", "first", "resumed")
    }


def trained(record: dict) -> list[int]:
    return [pack for step in record["steps"] for pack in step]


def check_coverage_resume_and_isolation(runs: dict[str, list[dict]], packs: int) -> None:
    epoch = [trained(record) for record in runs["epoch"]]
    # Every pack once; DistributedSampler-style padding repeats a pack to even out the ranks.
    assert [len(ranks) for ranks in epoch] == [-(-packs // RANKS)] * RANKS
    counts = Counter(pack for ranks in epoch for pack in ranks)
    assert set(counts) == set(range(packs))
    assert sum(counts.values()) - packs == -packs % RANKS
    for rank in range(RANKS):
        first, resumed = runs["first"][rank]["steps"], runs["resumed"][rank]["steps"]
        assert len(first) == STEPS
        assert first + resumed == runs["epoch"][rank]["steps"], f"rank {rank} resumed elsewhere"
    for record in (record for phase in runs.values() for record in phase):
        assert record["kwargs"], "the model was never called"
        for kwargs in record["kwargs"]:
            assert kwargs == {"use_cache": False, "attention_mask": False, "cu_seq_lens_q": True}


def test_ddp_loop_with_stateful_dataloader(packed, tmp_path):
    runs = launch("loop", packed, tmp_path / "out")
    dataset = PackedDataset(packed)
    check_coverage_resume_and_isolation(runs, len(dataset))
    for rank in range(RANKS):
        refused = json.loads((tmp_path / "out" / f"loop-early-{rank}.json").read_text())["refused"]
        assert refused and "not initialised" in refused
    # An elastic restart: the state of the two-rank run resumes one rank, or three, and the rest of the
    # epoch is trained on exactly once.
    state = torch.load(tmp_path / "out" / "loop-state-0.pt")
    first = [pack for record in runs["first"] for pack in trained(record)]
    for world in (1, 3):
        rest = [pack for rank in range(world) for pack in resumed_packs(dataset, state, rank, world)]
        assert set(first + rest) == set(range(len(dataset)))
        left = len(dataset) - len(first)
        assert len(rest) == left + -left % world  # each once, but DistributedSampler's padding of the rest


def resumed_packs(dataset: PackedDataset, state: dict, rank: int, world: int) -> list[int]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    sampler = PackedSampler(dataset, seed=0, rank=rank, world_size=world)
    loader = StatefulDataLoader(
        dataset, 2, sampler=sampler, collate_fn=PackedCollator.for_dataset(dataset), num_workers=2
    )
    loader.load_state_dict(state)
    record = Record(dataset)
    return [pack for batch in loader for pack in record.packs(batch["input_ids"])]


def test_accelerate_loop_and_the_double_sharding_it_refuses(packed, tmp_path):
    runs = launch("accelerate", packed, tmp_path / "out")
    packs = len(PackedDataset(packed))
    check_coverage_resume_and_isolation(runs, packs)
    sharding = [json.loads((tmp_path / "out" / f"accelerate-sharding-{r}.json").read_text()) for r in range(RANKS)]
    for record in sharding:
        assert record["refused"] and "shards the loader again" in record["refused"]
    # The other recipe: an unsharded PackedSampler, sharded by Accelerate alone.
    counts = Counter(pack for record in sharding for pack in record["packs"])
    assert set(counts) == set(range(packs)) and sum(counts.values()) - packs < RANKS


@pytest.mark.parametrize("client", ["hf", "trl"])
def test_trainers(client, packed, tmp_path):
    runs = launch(client, packed, tmp_path / "out")
    check_coverage_resume_and_isolation(runs, len(PackedDataset(packed)))
