"""The training examples run as their docstrings say, on a tiny build, and print a finite final loss;
and the examples stay scripts: tests run them, never import them (examples/ is no package)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.corpus import training_build

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    return training_build(tmp_path_factory.mktemp("examples"), documents=60, longest=120, max_len=256)


@pytest.mark.parametrize(
    "script", ["train_plain_loop.py", "train_accelerate.py", "train_hf_trainer.py", "train_trl_sft.py"]
)
@pytest.mark.slow
def test_example_trains_and_prints_a_finite_loss(packed, script, tmp_path):
    # Offline and with a private cache: an example that tried to download anything fails here.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--data", str(packed), "--steps", "3"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    found = re.findall(r"^final loss (\S+)$", result.stdout, flags=re.MULTILINE)
    assert found, result.stdout[-2000:]
    assert math.isfinite(float(found[-1]))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_example_builds_its_images_and_trains(model_type, tmp_path):
    """examples/train_vision.py makes its corpus, processor directory and build itself: it needs no --data."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_vision.py"), "--steps", "2", "--workers", "1",
         "--model-type", model_type, "--workdir", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "demo" / "processor" / "preprocessor_config.json").is_file()
    real = re.findall(r"^real tokens (\d+), padding fraction (\S+)$", result.stdout, flags=re.MULTILINE)
    assert real and int(real[-1][0]) > 0 and 0 <= float(real[-1][1]) < 1, result.stdout[-2000:]
    found = re.findall(r"^final loss (\S+)$", result.stdout, flags=re.MULTILINE)
    assert found and math.isfinite(float(found[-1])), result.stdout[-2000:]


def test_no_test_imports_the_examples_as_a_package():
    """The demo's corpus and tokenizer come from running examples/chitchat.py (tests/demo_inputs.py)."""
    tests = Path(__file__).resolve().parents[1]
    importing = [
        path.name for path in sorted(tests.rglob("*.py"))
        if re.search(r"^\s*(from|import)\s+examples\b", path.read_text(encoding="utf-8"), flags=re.MULTILINE)
    ]
    assert importing == []


@pytest.fixture(scope="module")
def pairs_packed(tmp_path_factory) -> Path:
    """A pair build of examples/chitchat_pairs.py's first pairs."""
    import json

    import prepack
    from tests.demo_inputs import CHATML, chitchat_pairs, gpt2_directory

    root = tmp_path_factory.mktemp("pairs")
    corpus = root / "pairs.jsonl"
    corpus.write_text("".join(json.dumps(pair) + "\n" for pair in chitchat_pairs()[:40]))
    prepack.build(corpus, root / "packed", max_len=256, tokenizer=gpt2_directory(root / "gpt2", CHATML), chat=True,
                  pairs=True, overflow="drop", num_proc=1)
    return root / "packed"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_dpo_plain_loop.py", "train_dpo_trl.py", "train_dpo_plain_loop.py --reference ref",
                                    "train_dpo_trl.py --reference ref"])
def test_dpo_example_trains_on_a_pair_build(pairs_packed, script, tmp_path):
    """Both DPO recipes start at log 2 (policy == reference) and print a finite final loss, on stored
    reference log-probabilities too."""
    script, *options = script.split()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--data", str(pairs_packed), "--steps", "3", "--workers", "0", *options],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    first = re.findall(r"^step 1 loss (\S+)|'loss': '(\S+)'", result.stdout + result.stderr, flags=re.MULTILINE)[0]
    assert float(first[0] or first[1]) == pytest.approx(math.log(2), abs=1e-4)
    found = re.findall(r"^final loss (\S+)$", result.stdout, flags=re.MULTILINE)
    assert found and math.isfinite(float(found[-1])), result.stdout[-2000:]


@pytest.fixture(scope="module")
def group_inputs(tmp_path_factory) -> Path:
    """A directory of builds of chitchat exchanges: a group build (`packed`: the real answer first, three others
    after), a build of the same groups, the answer last, with ranks (`ranked`: --ranks-column; `tied`: two tied), and an unpaired
    build (`kto`) of the same exchanges as feedback in TRL's format (the real answer desirable, another not)."""
    import json

    import prepack
    from tests.demo_inputs import CHATML, chitchat, gpt2_directory

    root = tmp_path_factory.mktemp("groups")
    tokenizer = gpt2_directory(root / "gpt2", CHATML)
    turns = [c for c in chitchat() if len(c) >= 2][:24]
    others = [" no idea", " maybe", " yes"]
    corpus = root / "groups.jsonl"
    corpus.write_text("".join(json.dumps({"prompt": f"Q: {t[0]} A:", "completions": [f" {t[1]}", *others]}) + "\n" for t in turns))
    prepack.build(corpus, root / "packed", max_len=256, tokenizer=tokenizer, groups=True, overflow="drop", num_proc=1)
    ranked = root / "ranked.jsonl"
    ranked.write_text("".join(json.dumps({"prompt": f"Q: {t[0]} A:", "completions": [*others, f" {t[1]}"], "ranks": [3, 2, 4, 1]})
                              + "\n" for t in turns))
    prepack.build(ranked, root / "ranked", max_len=256, tokenizer=tokenizer, groups=True, overflow="drop", num_proc=1,
                  ranks_column="ranks")
    tied = root / "tied.jsonl"
    tied.write_text("".join(json.dumps({"prompt": f"Q: {t[0]} A:", "completions": [*others, f" {t[1]}"], "ranks": [2, 2, 4, 1]})
                            + "\n" for t in turns))
    prepack.build(tied, root / "tied", max_len=256, tokenizer=tokenizer, groups=True, overflow="drop", num_proc=1,
                  ranks_column="ranks")
    feedback = root / "feedback.jsonl"
    feedback.write_text("".join(
        json.dumps({"prompt": f"Q: {t[0]} A:", "completion": f" {t[1]}" if i % 2 else others[i % 3], "label": bool(i % 2)}) + "\n"
        for i, t in enumerate(turns)))
    prepack.build(feedback, root / "kto", max_len=256, tokenizer=tokenizer, unpaired=True, overflow="drop", num_proc=1)
    return root


@pytest.mark.slow
@pytest.mark.parametrize(("script", "data", "first_loss"), [
    ("train_groups_plain_loop.py", "packed", math.log(2)), ("train_groups_plain_loop.py", "ranked", math.log(24)),
    ("train_kto_plain_loop.py", "kto", 0.5), ("train_kto_trl.py", "kto", 0.5), ("train_kto_trl.py --reference ref", "kto", 0.5)])
def test_group_and_kto_examples_train(group_inputs, script, data, first_loss, tmp_path):
    """The group recipe (shared-prompt layout of a --groups build) starts at log 2, and on a build with ranks
    (Plackett-Luce over groups of 4) at log 4!, the KTO ones (an --unpaired build: TRL's unpaired format, KL
    completions planned from a seed; a plain loop, and TRL's KTOTrainer with a reference model or stored reference
    log-probabilities) at 0.5, policy == reference; all print a finite final loss."""
    script, *options = script.split()
    build = group_inputs / data
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, str(EXAMPLES / script), "--data", str(build), "--steps", "3", "--workers", "0",
                             "--batch-size", "4", *options], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    first = re.findall(r"^step 1 loss (\S+)|'loss': '(\S+)'", result.stdout + result.stderr, flags=re.MULTILINE)
    first = [a or b for a, b in first]
    assert first and float(first[0]) == pytest.approx(first_loss, abs=1e-4), result.stdout[-2000:]
    found = re.findall(r"^final loss (\S+)$", result.stdout, flags=re.MULTILINE)
    assert found and math.isfinite(float(found[-1])), result.stdout[-2000:]


@pytest.mark.slow  # loads a tiny model: ~3 s
def test_the_group_example_refuses_tied_ranks_by_name(group_inputs, tmp_path):
    """Plackett-Luce takes a strict ranking; the build accepts ties (competition ranks): the example says so, with
    the group and its ranks, at the first batch, before any step, and with no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, str(EXAMPLES / "train_groups_plain_loop.py"), "--data", str(group_inputs / "tied"),
                             "--steps", "3", "--workers", "0", "--batch-size", "4"], capture_output=True, text=True, timeout=600,
                            env=env, cwd=tmp_path)
    assert result.returncode == 1 and "step 1" not in result.stdout, result.stdout[-2000:]
    assert "Traceback" not in result.stderr and "has ranks [2, 2, 4, 1]" in result.stderr, result.stderr[-4000:]
    assert "ranks without ties" in result.stderr, result.stderr[-4000:]
