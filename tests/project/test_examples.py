"""The training examples run as their docstrings say, on a tiny build, and print a finite final loss;
and the examples stay scripts: tests run them, never import them (examples/ is no package).

The runs share one process (`tests/run_examples.py`, each script as `python SCRIPT ARGS` runs it, as `__main__`,
with its own working directory, stdout, stderr and exit status), which imports torch, transformers and TRL once
instead of once a script: the `example_runs` fixture runs, on its first use, every example run of the tests
selected, and each test checks what its own run printed."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.corpus import training_build

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUNNER = Path(__file__).resolve().parents[1] / "run_examples.py"

# pytest-timeout counts a test's setup: the first test here runs every example (each limited to RUN_SECONDS by the
# runner; what they take, `pytest tests/project/test_examples.py -n 0 --durations=5` prints).
pytestmark = pytest.mark.timeout(1800)


@dataclass(frozen=True)
class ExampleRun:
    returncode: int
    stdout: str
    stderr: str
    cwd: Path  # the run's own working directory


# The command line of each test's run, by the test function's name, from its parameters: (the script and its options,
# the build it trains on: the name of the fixture that makes it and a subdirectory in it, or None).
COMMANDS = {
    "test_example_trains_and_prints_a_finite_loss":
        lambda script: ([script, "--steps", "3"], ("packed", "")),
    "test_vision_example_builds_its_images_and_trains":  # train_vision.py makes its corpus, processor and build itself
        lambda model_type: (["train_vision.py", "--steps", "2", "--workers", "1", "--model-type", model_type,
                             "--workdir", "demo"], None),
    "test_dpo_example_trains_on_a_pair_build":
        lambda script: ([*script.split()[:1], "--steps", "3", "--workers", "0", *script.split()[1:]], ("pairs_packed", "")),
    "test_group_and_kto_examples_train":
        lambda script, data, first_loss: ([*script.split()[:1], "--steps", "3", "--workers", "0", "--batch-size", "4",
                                           *script.split()[1:]], ("group_inputs", data)),
    "test_the_group_example_refuses_tied_ranks_by_name":
        lambda: (["train_groups_plain_loop.py", "--steps", "3", "--workers", "0", "--batch-size", "4"], ("group_inputs", "tied")),
}


@pytest.fixture(scope="module")
def example_runs(request, tmp_path_factory) -> dict[str, ExampleRun]:
    """Every selected test's example run, by the test's name, all from one runner process (`tests/run_examples.py`),
    offline and with a cache of their own: an example that tried to download anything fails."""
    root = tmp_path_factory.mktemp("runs")
    tests = [item for item in request.session.items
             if item.module is request.module and item.originalname in COMMANDS]
    plan, names = [], []
    for index, item in enumerate(tests):
        params = item.callspec.params if hasattr(item, "callspec") else {}
        (script, *options), data = COMMANDS[item.originalname](**params)
        if data is not None:
            fixture, subdirectory = data
            options = ["--data", str(request.getfixturevalue(fixture) / subdirectory), *options]
        cwd = root / str(index)
        cwd.mkdir()
        plan.append({"argv": [str(EXAMPLES / script), *options], "cwd": str(cwd),
                     **{name: str(cwd / f".{name}") for name in ("stdout", "stderr", "status")}})
        names.append(item.name)
    (root / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(root / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    runner = subprocess.run([sys.executable, str(RUNNER), str(root / "plan.json")], capture_output=True, text=True,
                            env=env, cwd=root)
    runs = {}
    for name, run in zip(names, plan):
        status = Path(run["status"])
        runs[name] = (ExampleRun(int(status.read_text()), Path(run["stdout"]).read_text(),
                                 Path(run["stderr"]).read_text(), Path(run["cwd"])) if status.exists() else
                      f"the runner stopped before this run ({runner.returncode}):\n{runner.stderr[-4000:]}")
    return runs


@pytest.fixture
def example_run(request, example_runs) -> ExampleRun:
    """This test's example run (a test whose run the runner never reached fails, naming why)."""
    run = example_runs[request.node.name]
    assert isinstance(run, ExampleRun), run
    return run


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    return training_build(tmp_path_factory.mktemp("examples"), documents=60, longest=120, max_len=256)


@pytest.mark.parametrize(
    "script", ["train_plain_loop.py", "train_accelerate.py", "train_hf_trainer.py", "train_trl_sft.py"]
)
@pytest.mark.slow
@pytest.mark.xdist_group("examples")
def test_example_trains_and_prints_a_finite_loss(script, example_run):
    result = example_run
    assert result.returncode == 0, result.stderr[-4000:]
    found = re.findall(r"^final loss (\S+)$", result.stdout, flags=re.MULTILINE)
    assert found, result.stdout[-2000:]
    assert math.isfinite(float(found[-1]))


@pytest.mark.slow
@pytest.mark.xdist_group("examples")
@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_example_builds_its_images_and_trains(model_type, example_run):
    """examples/train_vision.py makes its corpus, processor directory and build itself: it needs no --data."""
    result = example_run
    assert result.returncode == 0, result.stderr[-4000:]
    assert (result.cwd / "demo" / "processor" / "preprocessor_config.json").is_file()
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
@pytest.mark.xdist_group("examples")
@pytest.mark.parametrize("script", ["train_dpo_plain_loop.py", "train_dpo_trl.py", "train_dpo_plain_loop.py --reference ref",
                                    "train_dpo_trl.py --reference ref"])
def test_dpo_example_trains_on_a_pair_build(script, example_run):
    """Both DPO recipes start at log 2 (policy == reference) and print a finite final loss, on stored
    reference log-probabilities too."""
    result = example_run
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
@pytest.mark.xdist_group("examples")
@pytest.mark.parametrize(("script", "data", "first_loss"), [
    ("train_groups_plain_loop.py", "packed", math.log(2)), ("train_groups_plain_loop.py", "ranked", math.log(24)),
    ("train_kto_plain_loop.py", "kto", 0.5), ("train_kto_trl.py", "kto", 0.5), ("train_kto_trl.py --reference ref", "kto", 0.5)])
def test_group_and_kto_examples_train(script, data, first_loss, example_run):
    """The group recipe (shared-prompt layout of a --groups build) starts at log 2, and on a build with ranks
    (Plackett-Luce over groups of 4) at log 4!, the KTO ones (an --unpaired build: TRL's unpaired format, KL
    completions planned from a seed; a plain loop, and TRL's KTOTrainer with a reference model or stored reference
    log-probabilities) at 0.5, policy == reference; all print a finite final loss."""
    result = example_run
    assert result.returncode == 0, result.stderr[-4000:]
    first = re.findall(r"^step 1 loss (\S+)|'loss': '(\S+)'", result.stdout + result.stderr, flags=re.MULTILINE)
    first = [a or b for a, b in first]
    assert first and float(first[0]) == pytest.approx(first_loss, abs=1e-4), result.stdout[-2000:]
    found = re.findall(r"^final loss (\S+)$", result.stdout, flags=re.MULTILINE)
    assert found and math.isfinite(float(found[-1])), result.stdout[-2000:]


@pytest.mark.slow  # loads a tiny model: ~3 s
@pytest.mark.xdist_group("examples")
def test_the_group_example_refuses_tied_ranks_by_name(example_run):
    """Plackett-Luce takes a strict ranking; the build accepts ties (competition ranks): the example says so, with
    the group and its ranks, at the first batch, before any step, and with no traceback."""
    result = example_run
    assert result.returncode == 1 and "step 1" not in result.stdout, result.stdout[-2000:]
    assert "Traceback" not in result.stderr and "has ranks [2, 2, 4, 1]" in result.stderr, result.stderr[-4000:]
    assert "ranks without ties" in result.stderr, result.stderr[-4000:]
