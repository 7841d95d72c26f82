"""benchmarks/bench_gpu_train.py and benchmarks/gpu_session.sh cannot rot: the batches each contender trains
on, the arguments, and the whole GPU session script run end to end on a CPU (tiny model, `--cpu-smoke`)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_gpu_train", ROOT / "benchmarks" / "bench_gpu_train.py")
bench = sys.modules["bench_gpu_train"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up there
_spec.loader.exec_module(bench)

LENGTHS = np.array([5, 300, 40, 4096, 17, 900, 1200, 64, 64, 2000, 3, 3500, 700, 128, 256, 9], dtype=np.int64)


def test_the_committed_lengths_are_the_chitchat_conversations():
    lengths = json.loads(bench.LENGTHS_FILE.read_text())["lengths"]
    assert len(lengths) == 7168 and min(lengths) >= 1 and sum(lengths) > 3_000_000


def test_every_contender_trains_each_conversation_at_most_once_within_its_budget():
    prepack = bench.prepack_steps(LENGTHS, 4096, rows=2, seed=0)
    documents = [index for step in prepack for pack in step for index in pack]
    assert len(documents) == len(set(documents))
    assert all(sum(LENGTHS[pack]) <= 4096 for step in prepack for pack in step)
    flattened = bench.flattened_steps(LENGTHS, 4096, seed=0)
    documents = [index for step in flattened for index in step]
    assert len(documents) == len(set(documents)) > len(LENGTHS) // 2  # the last, partial step is left out
    assert all(sum(LENGTHS[step]) <= 4096 for step in flattened)
    for grouped in (False, True):
        steps = bench.padded_steps(LENGTHS, 4, grouped, seed=0)
        assert len(steps) == 4 and sorted(i for step in steps for i in step) == list(range(len(LENGTHS)))
    # group_by_length: the first batch holds the longest conversation, and batches are sorted within.
    grouped = bench.padded_steps(LENGTHS, 4, True, seed=0)
    assert 3 in grouped[0]


def test_flex_contenders_that_change_shape_every_step_run_last():
    methods = len(bench.METHODS)
    order = bench.contenders(["sdpa", "flex_attention", "flash_attention_4"], list(bench.METHODS))
    assert order[:methods] == [("sdpa", method, "none") for method in bench.METHODS]
    assert order[2 * methods : 2 * methods + 2] == [("flex_attention", "prepack", "none"), ("flex_attention", "prepack-fixed", "none")]
    assert [attn for attn, _, _ in order[2 * methods + 2 :]] == ["flex_attention"] * 3


def test_each_contender_runs_in_every_compile_mode_asked():
    order = bench.contenders(["sdpa"], ["hf-flattening", "prepack-fixed"], ["none", "reduce-overhead"])
    assert order == [("sdpa", "hf-flattening", "none"), ("sdpa", "hf-flattening", "reduce-overhead"),
                     ("sdpa", "prepack-fixed", "none"), ("sdpa", "prepack-fixed", "reduce-overhead")]


def test_prepack_fixed_steps_are_fixed_shape_batches_within_the_cap():
    args = bench.parse_args(["--max-len", "4096", "--tokens-per-step", "8192", "--max-docs-per-pack", "3",
                             "--warmup", "1", "--steps", "2"])
    tokens = bench.random_tokens(LENGTHS, 512, seed=0)
    capped = bench.prepack_steps(LENGTHS, 4096, rows=2, seed=0, max_documents=3)
    assert max(len(pack) for step in capped for pack in step) == 3 < max(
        len(pack) for step in bench.prepack_steps(LENGTHS, 4096, rows=2, seed=0) for pack in step)
    steps = bench.collated_steps("prepack-fixed", "sdpa", LENGTHS, tokens, args)
    assert len(steps) == 3 and {len(step.batch["cu_seq_lens_q"]) for step in steps} == {2 * (3 + 1) + 1}
    assert {step.batch["max_length_q"] for step in steps} == {4096}


def test_the_table_counts_a_compiled_contenders_graphs():
    rows = [bench.Result("sdpa", "prepack-fixed", "default", 10.0, 0.1, 5.0, None, None, 2, 1.0, graphs=1, graph_breaks=0),
            bench.Result("sdpa", "prepack", "none", 10.0, 0.1, 5.0, None, None, 2, 1.0)]
    table = bench.markdown(rows, ["header"])
    assert "| sdpa | prepack-fixed | default | 10 | 10.0% | 5 | – | – | 1 (0) |" in table
    assert "| sdpa | prepack | none | 10 | 10.0% | 5 | – | – | – |" in table


def test_arguments():
    args = bench.parse_args(["--cpu-smoke", "--steps", "9"])
    assert (args.shape, args.steps, args.max_len) == ("tiny", 2, 256)
    with pytest.raises(SystemExit):
        bench.parse_args(["--tokens-per-step", "100", "--max-len", "4096"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--methods", "padded"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--compile", "max-autotune"])
    assert bench.parse_args([]).compile == ["none"]


@pytest.mark.slow
def test_the_gpu_session_script_runs_end_to_end_on_a_cpu(tmp_path):
    out = tmp_path / "out"
    env = {
        **os.environ, "OUT": str(out), "PYTHON": sys.executable, "SITE": str(tmp_path / "no-site"),
        "BENCH_ARGS": "--cpu-smoke --warmup 1 --steps 1", "PYTHONPATH": str(ROOT),
        "COMPILED_ARGS": "--cpu-smoke --warmup 1 --steps 1 --methods prepack-fixed --compile default",
    }
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh")], env=env, capture_output=True,
                            text=True, timeout=600)
    log = (out / "session.log").read_text()
    assert result.returncode == 0, log + result.stdout[-3000:] + result.stderr[-3000:]
    for part in ("probe", "gpu-tests", "benchmark", "compiled"):
        assert f"{part}: exit 0" in log, log
    assert "cuda False" in (out / "probe.txt").read_text()
    assert "<testsuite" in (out / "pytest-junit.xml").read_text()
    rows = [json.loads(line) for line in (out / "bench" / "results.jsonl").read_text().splitlines()]
    assert [(row["attn"], row["method"]) for row in rows] == [("sdpa", method) for method in bench.METHODS]
    assert all(row["error"] is None and row["real_tokens_per_s"] > 0 and row["steps"] == 1 for row in rows), rows
    by_method = {row["method"]: row for row in rows}
    assert by_method["padded-random"]["padding_fraction"] > by_method["prepack"]["padding_fraction"]
    assert by_method["hf-flattening"]["padding_fraction"] == 0
    assert "| sdpa | prepack | none |" in (out / "bench" / "results.md").read_text()
    compiled = [json.loads(line) for line in (out / "bench-compiled" / "results.jsonl").read_text().splitlines()]
    assert [(row["method"], row["compile"], row["graphs"], row["error"]) for row in compiled] == [
        ("prepack-fixed", "default", 1, None)]
