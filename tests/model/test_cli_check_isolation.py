"""`prepack check-isolation`, run in-process: exit 0 on an isolated model, 1 on a leak, 2 on bad input, on
a family prepack refuses and on a model that fails on the batch.

The models are tiny random ones from `tests/model/test_isolation.py`, saved to a temporary directory; nothing
is downloaded.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from prepack.model import packing

from prepack.model import families

from prepack.model import isolation

from prepack.model import tiny_models
from prepack.model import vision_sweep
from prepack.cli import Attention, Dtype, app
from tests.model.test_isolation import LEAK, tiny_model
from tests.tiny_models import tiny_config

MAX_LEN = 48  # tiny_model's max_position_embeddings is 64
TOLERANCE = 1e-4  # check_isolation's default for float32


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A float32 Llama saved with save_pretrained, and its config.json on its own."""
    root = tmp_path_factory.mktemp("model")
    model = tiny_model("llama", "sdpa", torch.float32)
    model.save_pretrained(root / "llama")
    model.config.to_json_file(root / "config.json")
    return root


def check(*args: str):
    return CliRunner().invoke(app, ["check-isolation", "--max-len", str(MAX_LEN), *args])


def logit_diff(output: str) -> float:
    return float(re.search(r"^largest logit difference\s+(\S+)", output, flags=re.MULTILINE).group(1))


@pytest.mark.parametrize("path", ["llama", "config.json"])
def test_an_isolated_model_exits_0_and_prints_a_small_difference(saved, path):
    result = check("--model", str(saved / path), "--attn", "sdpa")
    assert result.exit_code == 0, result.output
    assert logit_diff(result.output) < TOLERANCE
    assert f"transformers {transformers.__version__}, LlamaForCausalLM" in result.output
    assert "largest gradient difference" in result.output
    assert ("random weights" in result.output) == (path == "config.json")


def test_a_leak_exits_1(saved, monkeypatch):
    """Without enable_packing, sdpa with use_cache left at the config's True builds a cache, and then
    transformers stops keeping the documents apart (PackedCollator's batches say use_cache=False:
    this one comes from a collator that does not)."""

    class CollatorWithoutUseCache(isolation.PackedCollator):
        def __call__(self, packs):
            return {key: value for key, value in super().__call__(packs).items() if key != "use_cache"}

    monkeypatch.setattr(isolation, "enable_packing", lambda model, **options: model)
    monkeypatch.setattr(isolation, "PackedCollator", CollatorWithoutUseCache)
    result = check("--model", str(saved / "llama"), "--attn", "sdpa", "--no-gradients")
    assert result.exit_code == 1, result.output
    assert logit_diff(result.output) > LEAK
    assert re.search(r"^LEAK: .*largest logit difference.* over the tolerance", result.output, flags=re.MULTILINE)


def test_a_missing_path_exits_2_and_names_it(tmp_path):
    missing = tmp_path / "no-model-here"
    result = check("--model", str(missing))
    assert result.exit_code == 2
    # Whitespace dropped: the error console wraps long lines, even inside a path.
    assert str(missing) in "".join(result.output.split())


@pytest.mark.parametrize(("device", "message"), [
    ("junk", "device 'junk' is not a torch device"),
    ("cuda", "device 'cuda': this torch ("),
    ("meta", "device 'meta' holds no values"),
])
def test_a_device_it_cannot_run_on_exits_2_with_the_reason(saved, monkeypatch, device, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without CUDA, here too
    result = check("--model", str(saved / "config.json"), "--device", device, "--no-gradients")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert message in " ".join(result.output.split())


def test_a_model_whose_config_does_not_match_its_weights_exits_2(saved, tmp_path):
    """A config of more layers than the weights hold: transformers would fill the missing ones at random."""
    model = Path(shutil.copytree(saved / "llama", tmp_path / "llama"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    result = check("--model", str(model), "--no-gradients")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "its config does not match its weights" in " ".join(result.output.split())


@pytest.mark.parametrize("attn", ["flash_attention_2", "flash_attention_4"])
def test_flash_attention_without_cuda_exits_2_with_the_reason(saved, attn):
    result = check("--model", str(saved / "config.json"), "--attn", attn, "--device", "cpu")
    assert result.exit_code == 2
    assert "needs a CUDA device and flash-attn" in " ".join(result.output.split())


def test_the_cli_choices_are_the_librarys():
    assert {attn.value for attn in Attention} == set(packing.SUPPORTED_ATTENTION)
    assert {dtype.value for dtype in Dtype} == {str(known).removeprefix("torch.") for known in isolation._TOLERANCES}


def test_the_cli_imports_neither_torch_nor_transformers():
    """`prepack build` must not pay for them: check-isolation imports them when it runs."""
    code = "import sys, prepack.cli; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# --- the family table's verdicts, float64 by default, and a crash told from a leak ---------------------


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """config.json of tiny random models of a few families (tests/tiny_models.py)."""
    root = tmp_path_factory.mktemp("configs")
    for model_type in ("zaya", "gpt_oss", "inkling_text", "qwen3_next"):
        tiny_config(model_type).to_json_file(root / f"{model_type}.json")
    return root


def let_through(monkeypatch, model_type: str):
    monkeypatch.setitem(families.FAMILIES, model_type, (families.NATIVE,) * len(families.BACKENDS))


def test_a_refused_family_exits_2_with_the_reason(configs):
    result = check("--model", str(configs / "zaya.json"), "--max-len", "32", "--no-gradients")
    output = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "zaya (ZayaForCausalLM) on sdpa" in output and families.ZAYA.reason in output


def test_a_model_that_fails_on_the_batch_exits_2_not_1(configs, monkeypatch):
    """Qwen3-Next let through: transformers' own gated delta rule raises on packed rows without fla."""
    let_through(monkeypatch, "qwen3_next")
    result = check("--model", str(configs / "qwen3_next.json"), "--max-len", "32", "--no-gradients")
    assert result.exit_code == 2, result.output
    assert "failed on the packed batch or on a document alone" in " ".join(result.output.split())


@pytest.mark.slow
def test_float64_on_cpu_by_default_catches_a_leak_float32_misses(configs, monkeypatch):
    """InklingText's short convolutions, let through, leak by about 1e-5: under float32's 1e-4 tolerance."""
    let_through(monkeypatch, "inkling_text")
    model = str(configs / "inkling_text.json")
    result = check("--model", model, "--max-len", "32", "--no-gradients")
    assert result.exit_code == 1, result.output
    assert "float64 on cpu" in result.output and 1e-6 < logit_diff(result.output) < TOLERANCE
    assert check("--model", model, "--max-len", "32", "--no-gradients", "--dtype", "float32").exit_code == 0


@pytest.mark.slow
def test_gpt_oss_on_eager_is_isolated_in_float64(configs):
    """Its MoE experts default to grouped_mm, which has no float64 kernel: check-isolation selects the
    eager experts. And prepack passes eager the masks gpt-oss builds without position_ids."""
    result = check("--model", str(configs / "gpt_oss.json"), "--attn", "eager", "--max-len", "32")
    assert result.exit_code == 0, result.output
    assert "float64 on cpu" in result.output and "largest gradient difference" in result.output


def test_a_model_transformers_cannot_build_exits_2_with_its_error(tmp_path):
    """MusicgenConfig's own defaults fail in transformers 5.24 with an AttributeError, not a ValueError."""
    config = tmp_path / "config.json"
    transformers.MusicgenConfig().to_json_file(config)
    result = check("--model", str(config), "--no-gradients")
    assert result.exit_code == 2, result.output
    assert "no causal language model loads from it" in " ".join(result.output.split())


@pytest.mark.slow  # compiles flex_attention for the CPU: half a minute
def test_flex_attention_on_cpu_runs_compiled_in_float32_on_logits_and_loss(saved):
    """torch's compiled flex has no float64 and no backward on a CPU: float32, and no gradient line."""
    result = check("--model", str(saved / "config.json"), "--attn", "flex_attention", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "attention flex_attention, float32 on cpu" in result.output
    assert "largest gradient difference" not in result.output and logit_diff(result.output) < TOLERANCE


# --- another transformers release, and the sweep that re-measures its families ---------------------------


def test_another_transformers_release_is_named_with_the_command_that_re_measures(saved, monkeypatch):
    # the module the command imports (a test before may have replaced the one imported here)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.97.0")
    result = check("--model", str(saved / "config.json"), "--no-gradients")
    output = " ".join(result.output.split())
    assert f"transformers 5.97.0: prepack's table of families was measured on {families.MEASURED_WITH}" in output
    assert families.SWEEP_COMMAND in output


def test_the_measured_release_is_not_flagged(saved, monkeypatch):
    monkeypatch.setattr(sys.modules["transformers"], "__version__", families.MEASURED_VERSION)
    result = check("--model", str(saved / "config.json"), "--no-gradients")
    assert result.exit_code == 0 and "was measured on" not in result.output, result.output


def test_the_sweep_checks_every_family_against_the_table(monkeypatch):
    """Two families stand for all (the whole sweep takes minutes): qwen3 isolated, zaya refused; with images,
    llava isolated and blip refused (transformers has no sdpa for it)."""
    monkeypatch.setattr(tiny_models, "CAUSAL_LM_TYPES", ("qwen3", "zaya"))
    monkeypatch.setattr(vision_sweep, "IMAGE_TEXT_TYPES", ("blip", "llava"))
    result = CliRunner().invoke(app, ["check-isolation", "--sweep"])
    assert result.exit_code == 0, result.output
    assert re.search(r"^qwen3 +table: isolated \(native\) +measured: isolated$", result.output, flags=re.MULTILINE)
    assert re.search(r"^zaya +table: refused +measured: refused: ", result.output, flags=re.MULTILINE)
    assert re.search(r"^llava \(images\) +table: isolated \(native\) +measured: isolated \(native\)$", result.output,
                     flags=re.MULTILINE)
    assert re.search(r"^blip \(images\) +table: refused +measured: refused: transformers has no sdpa attention for "
                     r"this family$", result.output, flags=re.MULTILINE)
    assert "every family gives prepack's table's verdict on sdpa." in result.output


def test_the_sweep_exits_1_on_a_family_the_table_lacks(monkeypatch):
    """A family a newer release registers: measured, and reported as not in the table."""
    monkeypatch.setattr(tiny_models, "CAUSAL_LM_TYPES", ("qwen3",))
    monkeypatch.setattr(vision_sweep, "IMAGE_TEXT_TYPES", ())
    monkeypatch.delitem(families.FAMILIES, "qwen3")
    result = CliRunner().invoke(app, ["check-isolation", "--sweep"])
    assert result.exit_code == 1, result.output
    assert re.search(r"^qwen3 +table: not measured on this version +measured: isolated  DIFFERS$", result.output, flags=re.MULTILINE)


@pytest.mark.parametrize("arguments", [[], ["--sweep", "--model", "config.json"]])
def test_model_or_sweep_one_of_the_two(arguments):
    result = CliRunner().invoke(app, ["check-isolation", *arguments])
    assert result.exit_code == 2 and "--model DIR or --sweep" in result.output, result.output
