"""A missing optional dependency is announced one way: MissingExtraError (a PrepackError, exit 2 from the
CLI) naming the extra's install line. Each absence is simulated in a fresh interpreter by
`sys.modules[name] = None`, which makes `import name` fail as it does when the package is not installed."""

from __future__ import annotations

import pickle
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from prepack.errors import EXTRAS, MissingExtraError, PrepackError, optional_imports
from tests.corpus import corpus_table, write_corpus


def _install_line(extra: str) -> str:
    return f"pip install 'prepack-llm[{extra}]' (from a checkout of prepack: pip install -e '.[{extra}]')"


def _without(missing: list[str], code: str, cwd) -> subprocess.CompletedProcess:
    hide = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in missing)
    return subprocess.run([sys.executable, "-c", hide + code], capture_output=True, text=True, cwd=cwd, timeout=300)


def _raises(missing: list[str], code: str, cwd) -> str:
    """The message of the MissingExtraError that `code` raises with `missing` absent, and nothing else."""
    program = f"from prepack.errors import MissingExtraError\ntry:\n    {code}\nexcept MissingExtraError as exc:\n    print('raised', exc.module, exc.extra, exc)\n"
    result = _without(missing, program, cwd)
    assert result.returncode == 0 and result.stdout.startswith("raised "), result.stdout + result.stderr
    return result.stdout.split(" ", 1)[1].strip()


def _cli(missing: list[str], args: list[str], cwd) -> str:
    """stderr of `prepack ARGS` with `missing` absent, asserting exit 2 and no traceback."""
    result = _without(missing, f"from prepack.cli import app\napp({args!r}, prog_name='prepack')", cwd)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return " ".join(result.stderr.split())


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("PackedDataset", "torch"),
        ("PackedSampler", "torch"),
        ("PackedCollator", "torch"),
        ("loss_weights", "torch"),
        ("split_for_cp", "torch"),
        ("enable_packing", "torch"),
        ("enable_packing", "transformers"),
        ("check_isolation", "transformers"),
        ("UsefulThroughputCallback", "torch"),
        ("UsefulThroughputCallback", "transformers"),
    ],
)
@pytest.mark.slow
def test_training_names_without_the_train_extra(tmp_path, name, module):
    message = _raises([module], f"import prepack; prepack.{name}", tmp_path)
    assert message.startswith(f"{module} train ") and message.endswith(_install_line("train"))


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    from prepack import build

    root = tmp_path_factory.mktemp("extras")
    corpus = write_corpus(root / "c.parquet", corpus_table([[1, 2, 3], [4, 5], [6]]))
    build(corpus, root / "packed", max_len=4)
    return root


@pytest.mark.slow
def test_open_hf_dataset_without_datasets(packed):
    message = _raises(["datasets"], "import prepack; prepack.open_hf_dataset('packed')", packed)
    assert message == f"datasets train open_hf_dataset needs datasets, which is not installed: {_install_line('train')}"


@pytest.mark.parametrize("module", ["tokenizers", "jinja2"])
def test_tokenizing_without_the_tokenize_extra(packed, module):
    message = _cli([module], ["build", "c.parquet", "--tokenizer", ".", "--out", "out"], packed)
    assert f"needs {module}, which is not installed: {_install_line('tokenize')}" in message
    assert not (packed / "out").exists()


@pytest.mark.parametrize(("uri", "module", "extra"), [("s3://bucket/c/", "s3fs", "s3"), ("gs://bucket/c/", "gcsfs", "gcs"), ("s3://bucket/c/", "fsspec", "s3")])
def test_object_storage_without_its_client(packed, uri, module, extra):
    message = _cli([module], ["build", uri, "--out", "out"], packed)
    assert message == f"error: {uri} needs {module}, which is not installed: {_install_line(extra)}"


def test_the_ray_engine_without_ray(packed):
    message = _cli(["ray"], ["build", "c.parquet", "--engine", "ray", "--out", "out"], packed)
    assert message == f"error: --engine ray needs ray, which is not installed: {_install_line('ray')}"
    assert not (packed / "out").exists()


def test_plot_without_matplotlib(packed):
    message = _cli(["matplotlib"], ["inspect", "packed", "--plot", "report.png"], packed)
    assert message == f"error: plotting (inspect --plot) needs matplotlib, which is not installed: {_install_line('plot')}"
    assert not (packed / "report.png").exists()


@pytest.mark.parametrize(("to", "module", "extra", "needed_by"), [
    ("parquet", "matplotlib", "plot", "prepack export --to parquet (its card's figure)"),
    ("lance", "lance", "export", "prepack export --to lance"),
])
def test_an_export_without_its_writer(packed, to, module, extra, needed_by):
    message = _cli([module], ["export", "packed", "--to", to, "--out", "exported"], packed)
    assert message == f"error: {needed_by} needs {module}, which is not installed: {_install_line(extra)}"
    assert not [path.name for path in packed.iterdir() if "exported" in path.name]  # no export, staging or lock


@pytest.mark.parametrize("module", ["torch", "transformers"])
def test_check_isolation_without_the_train_extra(tmp_path, module):
    message = _cli([module], ["check-isolation", "--model", str(tmp_path)], tmp_path)
    assert message.endswith(f"needs {module}, which is not installed: {_install_line('train')}")


@pytest.mark.slow  # imports torch and transformers: ~10 s
def test_flash_attention_without_flash_attn(tmp_path):
    code = "import torch; from prepack.model.isolation import _require_flash_kernels; _require_flash_kernels('flash_attention_2', 'bfloat16', torch.device('cuda'))"
    message = _raises(["flash_attn"], code, tmp_path)
    assert message == f"flash_attn flash --attn flash_attention_2 needs flash_attn, which is not installed: {_install_line('flash')}"


def test_the_error_is_a_prepack_error_and_an_import_error_and_pickles_whole():
    error = MissingExtraError("ray", "--engine ray")
    assert isinstance(error, PrepackError) and isinstance(error, ImportError) and error.name == "ray"
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), str(again), again.extra) == (MissingExtraError, str(error), "ray")


def test_only_missing_optional_dependencies_are_translated():
    with pytest.raises(ModuleNotFoundError) as caught, optional_imports("a test"):
        import prepack_no_such_module  # noqa: F401
    assert type(caught.value) is ModuleNotFoundError


def test_every_extra_named_is_one_of_pyproject():
    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(EXTRAS.values()) <= set(extras)


def test_the_image_checks_need_no_tokenize_extra(tmp_path):
    # `verify --images` reads images (Pillow), no tokenizer: the module that prepares them loads one only there.
    code = "from prepack.check.images import verify_images\nimport prepack.sources.images\nprint('imported')"
    result = _without(["tokenizers", "jinja2"], code, tmp_path)
    assert result.stdout.strip() == "imported", result.stderr
