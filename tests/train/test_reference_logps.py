"""Reference log-probabilities stored beside a preference-pair build (`prepack.training.reference`): in float64
on a tiny random Llama, the DPO loss from the stored values equals the one that runs the reference model in
the loop, and the stored values equal each sequence run alone; a run stopped after one shard and run again
writes the bytes of one never stopped; `verify --reference` (and the loader) refuse every kind of tampering.
`open_hf_dataset(..., reference=)` serves the loader's values and refuses what it refuses, and
examples/train_dpo_trl.py on them holds no reference model and gives the in-loop loss.

The build (examples/chitchat_pairs.py's first pairs, as tests/train/test_preference.py builds them) is cut
into four shards, so that a run has shards to stop between.
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import runpy
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

import prepack
from prepack import PackedDataset
from prepack.check.reference import verify_reference
from prepack.errors import FormatError, InputError, OutputError, UsageError
from prepack.formats.common import list_array, list_column
from prepack.formats.reference import REFERENCE_MANIFEST, REFERENCE_SCHEMA, read_reference_manifest
from prepack.model.packing import enable_packing
from prepack.storage.files import write_record_batch
from prepack.training.collate import PackedCollator
from prepack.training.dataset import open_hf_dataset
from prepack.training.preference import dpo_loss, ipo_loss, model_inputs, pair_logps
from prepack.training.reference import stored_reference, write_reference_logps
from tests.cli import WIDE, failure, invoke_prepack, run_prepack
from tests.train.test_preference import BETA, PAIRS, pair_build, pairs_of
from tests.train.test_preference import tiny_llama as preference_tiny_llama

SHARD_BYTES = 3000  # four shards of one or two packs
VOCAB = 50_259  # the demo tokenizer's ids, whole: the writer reads the build's labels as they are


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    return pair_build(tmp_path_factory.mktemp("reference"), shard_size=SHARD_BYTES)


def tiny_llama(seed: int) -> torch.nn.Module:
    return preference_tiny_llama(seed, VOCAB)


class TinyReference(torch.nn.Module):
    """The frozen reference (tiny_llama(1), packing enabled); `fail_at` makes its forward number
    `fail_at` (1-based) raise, as a run killed there would stop."""

    def __init__(self, fail_at: int | None = None):
        super().__init__()
        self.model = enable_packing(tiny_llama(1)).eval()
        self.fail_at, self.calls = fail_at, 0

    def forward(self, **inputs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyboardInterrupt("stopped")
        return self.model(**inputs)


def alone(model, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's chosen and rejected summed log-probability, every document run alone, unpacked."""
    sums = []
    for pair in pairs:
        for ids, labels in pair:
            ids, labels = torch.as_tensor(ids.astype(np.int64)), torch.as_tensor(labels.astype(np.int64))
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1], -1).gather(1, ids[1:, None])[:, 0]
            sums.append((logp * (labels[1:] != -100)).sum())
    values = torch.stack(sums).reshape(-1, 2)
    return values[:, 0], values[:, 1]


@pytest.fixture(scope="module")
def reference(build, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "values"
    write_reference_logps(build, TinyReference().eval(), out, batch_size=1)
    return out


def batches(build: Path, reference: Path | None = None) -> list[dict]:
    dataset = PackedDataset(build, reference=reference)
    collate = PackedCollator.for_dataset(dataset)
    result = []
    for first in range(0, len(dataset), 2):
        result.append(collate([dataset[i] for i in range(first, min(first + 2, len(dataset)))]))
    return result


def test_the_build_has_several_shards(build):
    manifest = prepack.formats.shards.read_manifest(build)
    assert len(manifest.shards) >= 3 and manifest.pairs.pairs == PAIRS


def _losses_agree(policy, in_loop, batch: dict, plain: dict) -> None:
    """DPO and IPO from the stored values of `batch` equal those from the reference run on `plain` (the same
    packs, collated without them)."""
    with torch.no_grad():  # the reference is a constant of the loss: its values decide the gradients too
        logps = pair_logps(policy(**model_inputs(batch)).logits, batch)  # model_inputs drops reference_logps
        looped = pair_logps(in_loop(**model_inputs(plain)).logits, plain)
    from_store = stored_reference(batch)
    for name in looped._fields:
        torch.testing.assert_close(getattr(from_store, name), getattr(looped, name), rtol=1e-12, atol=1e-10, msg=name)
    for loss in (dpo_loss, ipo_loss):
        torch.testing.assert_close(loss(logps, from_store, BETA).mean(), loss(logps, looped, BETA).mean(),
                                   rtol=1e-12, atol=1e-12)


def test_stored_reference_gives_the_loss_of_the_reference_in_the_loop(build, reference):
    batch, plain = batches(build, reference)[0], batches(build)[0]
    assert "reference_logps" not in plain and batch["reference_logps"].dtype == torch.float64
    assert batch["reference_logps"].shape == (len(batch["pair_segments"]), 2)
    # The same values in the padding-free layout, and from a dataset pickled into a DataLoader worker.
    dataset = pickle.loads(pickle.dumps(PackedDataset(build, reference=reference)))
    free = PackedCollator.for_dataset(dataset, layout="padding_free")([dataset[0], dataset[1]])
    assert torch.equal(free["reference_logps"], batch["reference_logps"])
    _losses_agree(enable_packing(tiny_llama(0)), enable_packing(tiny_llama(1)).eval(), batch, plain)


@pytest.mark.slow  # every pack, and every document run alone, through a 50k-token vocabulary in float64: ~10 s
def test_every_stored_value_is_the_document_run_alone(build, reference):
    manifest = read_reference_manifest(reference)
    assert manifest.complete and len(manifest.files) == len(prepack.formats.shards.read_manifest(build).shards)
    in_loop = enable_packing(tiny_llama(1)).eval()
    stored_batches = batches(build, reference)
    with torch.no_grad():
        # Every stored value is the document's own, run alone (plain unpacked forward).
        chosen, rejected = alone(tiny_llama(1), pairs_of(build))
        stored = [stored_reference(batch) for batch in stored_batches]
        torch.testing.assert_close(torch.cat([r.chosen for r in stored]), chosen, rtol=1e-12, atol=1e-10)
        torch.testing.assert_close(torch.cat([r.rejected for r in stored]), rejected, rtol=1e-12, atol=1e-10)
    policy = enable_packing(tiny_llama(0))
    for batch, plain in zip(stored_batches, batches(build)):
        _losses_agree(policy, in_loop, batch, plain)


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _staging(out: Path) -> Path:
    """The one hidden directory a stopped run to `out` left beside it, holding what it finished in `build/`."""
    [staging] = [path for path in out.parent.iterdir() if path.name.startswith(f".{out.name}.tmp-")]
    return staging


def test_a_stopped_run_publishes_nothing_and_the_next_goes_on_to_the_bytes_of_an_uninterrupted_one(build, reference, tmp_path):
    shards = prepack.formats.shards.read_manifest(build).shards
    out = tmp_path / "values"
    # batch_size 1: forward number rows(shard 0) + 1 is the first of shard 1.
    with pytest.raises(KeyboardInterrupt):
        write_reference_logps(build, TinyReference(fail_at=shards[0].rows + 1).eval(), out, batch_size=1)
    assert not out.exists()  # the directory appears whole or not at all
    staging = _staging(out)
    assert [p.name for p in tmp_path.iterdir()] == [staging.name]  # no lock left behind
    assert [file.name for file in read_reference_manifest(staging / "build").files] == ["reference-00000.arrow"]
    with pytest.raises(FormatError, match="does not exist"):
        PackedDataset(build, reference=out)
    # As if the run had also written shard 1's file and stopped before listing it, and left a temporary file.
    shutil.copyfile(reference / "reference-00001.arrow", staging / "build" / "reference-00001.arrow")
    (staging / "build" / ".reference-00002.arrow.tmp-0123abcd").write_bytes(b"partial")
    model = TinyReference().eval()
    write_reference_logps(build, model, out, batch_size=1)
    assert model.calls == sum(shard.rows for shard in shards[1:])  # shard 0 checked, not computed again
    assert _snapshot(out) == _snapshot(reference)
    assert [p.name for p in tmp_path.iterdir()] == ["values"]  # the stopped run's directory was the one published
    assert verify_reference(build, out) == []


@pytest.mark.slow  # two runs over the build: ~10 s
@pytest.mark.parametrize("stopped", ["of another model", "with a damaged file"])
def test_a_stopped_run_of_another_model_or_with_a_damaged_file_is_deleted_not_taken_up(build, reference, tmp_path, stopped):
    out = tmp_path / "values"
    other = TinyReference(fail_at=3).eval()
    if stopped == "of another model":
        with torch.no_grad():
            other.model.model.embed_tokens.weight[0, 0] += 1
    with pytest.raises(KeyboardInterrupt):
        write_reference_logps(build, other, out, batch_size=1)
    assert read_reference_manifest(_staging(out) / "build").files  # it finished a file
    if stopped == "with a damaged file":
        _flip_a_byte(_staging(out) / "build", "reference-00000.arrow")
    model = TinyReference().eval()
    write_reference_logps(build, model, out, batch_size=1)
    assert model.calls == 6 and _snapshot(out) == _snapshot(reference)
    assert [p.name for p in tmp_path.iterdir()] == ["values"]


def test_an_existing_directory_is_taken_only_when_it_holds_this_model_s_finished_values(build, reference, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(OutputError, match="empty already exists"):
        write_reference_logps(build, TinyReference().eval(), tmp_path / "empty")
    assert list((tmp_path / "empty").iterdir()) == []
    finished = Path(shutil.copytree(reference, tmp_path / "finished"))
    model = TinyReference().eval()
    assert write_reference_logps(build, model, finished) == read_reference_manifest(reference)
    assert model.calls == 0 and _snapshot(finished) == _snapshot(reference)  # checked, not computed
    unfinished = Path(shutil.copytree(reference, tmp_path / "unfinished"))
    manifest = json.loads((unfinished / REFERENCE_MANIFEST).read_text())
    manifest["files"] = manifest["files"][:1]
    (unfinished / REFERENCE_MANIFEST).write_text(json.dumps(manifest))
    before = _snapshot(unfinished)
    with pytest.raises(OutputError, match="lists 1 of the build's 4 shards: not a finished reference directory"):
        write_reference_logps(build, TinyReference().eval(), unfinished)
    assert _snapshot(unfinished) == before


def test_a_model_whose_vocabulary_is_smaller_than_the_build_s_ids_is_refused_before_it_runs(build, tmp_path):
    largest = max(int(pack["input_ids"].max()) for pack in PackedDataset(build))

    class SmallVocabulary(TinyReference):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.model = enable_packing(preference_tiny_llama(1, largest)).eval()  # ids 0 .. largest - 1
            self.fail_at, self.calls = None, 0

        def get_input_embeddings(self):
            return self.model.get_input_embeddings()

    model = SmallVocabulary().eval()
    with pytest.raises(InputError, match=rf"column 'input_ids': holds token id {largest}; the reference model .* has {largest} ids in its vocabulary"):
        write_reference_logps(build, model, tmp_path / "values")
    assert model.calls == 0 and list(tmp_path.iterdir()) == []


def test_progress_shows_packs_done_on_the_console_given(build, reference, tmp_path):
    """On finished values, checked and not computed (the command's test shows them computed)."""
    from rich.console import Console

    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    finished = shutil.copytree(reference, tmp_path / "values")
    write_reference_logps(build, TinyReference().eval(), finished, progress=True, console=console)
    shown = console.file.getvalue()
    assert "reference log-probabilities" in shown and "6/6" in shown
    quiet = Console(file=io.StringIO(), force_terminal=True, width=120)
    write_reference_logps(build, TinyReference().eval(), finished, console=quiet)
    assert quiet.file.getvalue() == ""


def test_a_run_refuses_another_model_foreign_files_and_a_differing_file(build, reference, tmp_path):
    out = tmp_path / "values"
    shutil.copytree(reference, out)
    before = _snapshot(out)
    other = TinyReference().eval()
    with torch.no_grad():
        other.model.model.embed_tokens.weight[0, 0] += 1
    with pytest.raises(OutputError, match="not of this one"):
        write_reference_logps(build, other, out)
    with pytest.raises(UsageError, match="training mode"):
        write_reference_logps(build, TinyReference().train(), out)
    assert _snapshot(out) == before
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="notes.txt, which prepack did not write"):
        write_reference_logps(build, TinyReference().eval(), tmp_path / "mine")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    # A model that gives a document no finite value writes nothing.
    class NotFinite(TinyReference):
        def forward(self, **inputs):
            output = super().forward(**inputs)
            output.logits = output.logits * float("nan")
            return output

    with pytest.raises(InputError, match="the log-probability nan: a reference must give every trained token a finite one"):
        write_reference_logps(build, NotFinite().eval(), tmp_path / "nan")
    assert not (tmp_path / "nan").exists() and not list(tmp_path.glob(".nan*"))
    # An unlisted file under a reference file's name that holds other values is not replaced: a stopped run's
    # file, left under the name shard 1's would take.
    stopped = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        write_reference_logps(build, TinyReference(fail_at=prepack.formats.shards.read_manifest(build).shards[0].rows + 1).eval(),
                              stopped, batch_size=1)
    unlisted = _staging(stopped) / "build" / "reference-00001.arrow"
    unlisted.write_bytes(b"not these values")
    with pytest.raises(OutputError, match="reference-00001.arrow exists, is not listed"):
        write_reference_logps(build, TinyReference().eval(), stopped, batch_size=1)
    assert unlisted.read_bytes() == b"not these values" and not stopped.exists()


def _rewrite(directory: Path, name: str, offsets: np.ndarray, values: np.ndarray) -> None:
    """Replace a file by these values, its manifest entry's bytes and sha256 updated to match."""
    size, sha256 = write_record_batch(directory / name, pa.RecordBatch.from_arrays([list_array(offsets, values)],
                                                                                    schema=REFERENCE_SCHEMA))
    manifest = json.loads((directory / REFERENCE_MANIFEST).read_text())
    entry = next(file for file in manifest["files"] if file["name"] == name)
    entry.update(bytes=size, sha256=sha256)
    (directory / REFERENCE_MANIFEST).write_text(json.dumps(manifest))


def _values(directory: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    batch = pa.ipc.open_stream((directory / name).read_bytes()).read_next_batch()
    offsets, values = list_column(batch, "logps")
    return offsets.copy(), values.copy()


def _flip_a_byte(directory: Path, name: str) -> None:
    data = bytearray((directory / name).read_bytes())
    data[len(data) // 2] ^= 1
    (directory / name).write_bytes(bytes(data))


def _fewer_rows(directory: Path, name: str) -> None:
    offsets, values = _values(directory, name)
    _rewrite(directory, name, offsets[:-1], values[: offsets[-2]])


def _moved_value(directory: Path, name: str) -> None:
    offsets, values = _values(directory, name)
    offsets[1] -= 1  # row 0's last value becomes row 1's first
    _rewrite(directory, name, offsets, values)


def _nan(directory: Path, name: str) -> None:
    offsets, values = _values(directory, name)
    values[-1] = np.nan
    _rewrite(directory, name, offsets, values)


def _edit_manifest(change):
    def edit(directory: Path, name: str) -> None:
        manifest = json.loads((directory / REFERENCE_MANIFEST).read_text())
        change(manifest)
        (directory / REFERENCE_MANIFEST).write_text(json.dumps(manifest))

    return edit


TAMPERING = {
    "sha256": (_flip_a_byte, "sha256", "sha256 is"),
    "rows": (_fewer_rows, "logps", "rows; the build shard holds 2 packs"),
    "documents per pack": (_moved_value, "logps", "values; the pack holds"),
    "finite": (_nan, "logps", "is not a log-probability"),
    "missing": (lambda directory, name: (directory / name).unlink(), None, "missing"),
    "another build": (_edit_manifest(lambda m: m.update(build_fingerprint="0" * 64)), "build_fingerprint", "not of this one"),
    "incomplete": (_edit_manifest(lambda m: m["files"].pop()), "files", "of the build's"),
}


def _tampered(build: Path, reference: Path, out: Path, tampering: str) -> Path:
    """A copy of `reference` in `out`, TAMPERING[tampering] done to the file of a shard of two packs."""
    shutil.copytree(reference, out)
    two_packs = next(file.name for file, shard in zip(read_reference_manifest(out).files,
                                                      prepack.formats.shards.read_manifest(build).shards) if shard.rows == 2)
    TAMPERING[tampering][0](out, two_packs)
    return out


@pytest.mark.parametrize("tampering", sorted(TAMPERING))
def test_verify_reference_finds_every_tampering(build, reference, tmp_path, tampering):
    assert verify_reference(build, reference) == []
    _, column, message = TAMPERING[tampering]
    out = _tampered(build, reference, tmp_path / "values", tampering)
    problems = verify_reference(build, out)
    assert len(problems) == 1 and problems[0].column == column and message in problems[0].message, problems
    if tampering in ("rows", "documents per pack", "finite"):  # the loader checks these too, sha256 aside
        assert problems[0].row == (None if tampering == "rows" else {"documents per pack": 0, "finite": 1}[tampering])
        dataset = PackedDataset(build, reference=out)
        with pytest.raises(FormatError, match=message):
            [dataset[i] for i in range(len(dataset))]


def test_verify_reference_reports_a_missing_file_before_reading_its_damaged_build_shard(build, reference, tmp_path):
    """The reference file is opened first: its problem is the one reported, with no build shard read for it."""
    damaged = tmp_path / "build"
    shutil.copytree(build, damaged)
    out = _tampered(build, reference, tmp_path / "values", "missing")
    files = read_reference_manifest(out).files
    index = next(index for index, file in enumerate(files) if not (out / file.name).exists())
    (damaged / prepack.formats.shards.read_manifest(damaged).shards[index].name).write_bytes(b"not a shard")
    problems = verify_reference(damaged, out)
    assert [(problem.file, "missing" in problem.message) for problem in problems] == [(str(out / files[index].name), True)], problems


def test_verify_command_checks_the_reference(build, reference, tmp_path):
    clean = invoke_prepack("verify", build, "--reference", reference)
    assert clean.returncode == 0 and "reference log-probabilities checked" in clean.stdout, clean.stderr
    out = tmp_path / "values"
    shutil.copytree(reference, out)
    _nan(out, "reference-00000.arrow")
    found = invoke_prepack("verify", build, "--reference", out)
    assert found.returncode == 1 and "is not a log-probability" in found.stdout, (found.stdout, found.stderr)


@pytest.mark.slow  # three commands that import torch and transformers: ~25 s
def test_reference_logps_command_writes_the_library_s_values(build, reference, tmp_path):
    tiny_llama(1).save_pretrained(tmp_path / "ref-model")
    out = tmp_path / "values"
    result = run_prepack("reference-logps", build, "--model", tmp_path / "ref-model", "--out", out, "--batch-size", "1",
                         "--device", "cpu", env=WIDE)
    assert result.returncode == 0, result.stderr
    assert "reference log-probabilities of 6 packs (4 files) of ref-model" in result.stdout
    files = sorted(path.name for path in reference.glob("reference-*.arrow"))
    assert files == sorted(path.name for path in out.glob("reference-*.arrow")) and len(files) == 4
    for name in files:  # the manifests differ in the model's description only (TinyReference wraps the model)
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    assert verify_reference(build, out) == []
    # The same model from another directory is the same model: the run checks every file and computes none.
    shutil.copytree(tmp_path / "ref-model", tmp_path / "moved")
    again = invoke_prepack("reference-logps", build, "--model", tmp_path / "moved", "--out", out, "--device", "cpu", env=WIDE)
    assert again.returncode == 0, again.stderr
    message = failure(invoke_prepack("reference-logps", build, "--model", tmp_path / "nowhere", "--out", out, env=WIDE))
    assert "nowhere: no such model directory." in message


# --- the command on bad models and devices: a named error (exit 2), nothing written ----------------------


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    """tiny_llama(1), the reference of the tests above, saved as a model directory."""
    directory = tmp_path_factory.mktemp("models") / "ref-model"
    tiny_llama(1).save_pretrained(directory)
    return directory


def _config_edit(**fields):
    def edit(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, **fields}))

    return edit


def _truncate_weights(directory: Path) -> None:
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _small_vocabulary(directory: Path) -> None:
    shutil.rmtree(directory)
    preference_tiny_llama(1, 1000).save_pretrained(directory)


BAD_MODELS = {
    "vocabulary smaller than the build's ids": (_small_vocabulary, "column 'input_ids': holds token id"),
    "truncated weights": (_truncate_weights, "no causal language model loads from it: SafetensorError"),
    "config of more layers than the weights hold": (_config_edit(num_hidden_layers=3), "its config does not match its weights: 9 weights it needs are missing"),
    "config of fewer layers than the weights hold": (_config_edit(num_hidden_layers=1), "its config does not match its weights: 9 weights it holds are not used"),
    "config of another width": (_config_edit(hidden_size=64), "no causal language model loads from it"),
}


def _reference_logps(*args):
    from typer.testing import CliRunner

    from prepack.cli import app

    return CliRunner().invoke(app, ["reference-logps", *map(str, args)], env={"COLUMNS": "1000"})


def _refused(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    return " ".join(result.output.split())


@pytest.mark.parametrize("bad", sorted(BAD_MODELS))
def test_reference_logps_command_refuses_a_bad_model_with_a_named_error_and_writes_nothing(build, saved_model, tmp_path, bad):
    model = Path(shutil.copytree(saved_model, tmp_path / "model"))
    corrupt, message = BAD_MODELS[bad]
    corrupt(model)
    assert message in _refused(_reference_logps(build, "--model", model, "--out", tmp_path / "values", "--device", "cpu"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize(("device", "message"), [
    ("junk", "device 'junk' is not a torch device"),
    ("cuda", "device 'cuda': this torch (" ),
    ("cuda:1", "device 'cuda:1': this torch ("),
    ("meta", "device 'meta' holds no values"),
])
def test_reference_logps_command_refuses_a_device_it_cannot_run_on(build, saved_model, tmp_path, monkeypatch, device, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without CUDA, here too
    output = _refused(_reference_logps(build, "--model", saved_model, "--out", tmp_path / "values", "--device", device))
    assert message in output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # two runs over the build: ~3 s
def test_reference_logps_command_shows_progress_on_a_terminal_only(build, saved_model, tmp_path, monkeypatch):
    from rich.console import Console

    import prepack.cli

    piped = _reference_logps(build, "--model", saved_model, "--out", tmp_path / "piped", "--device", "cpu")
    assert piped.exit_code == 0 and "━" not in piped.output and "6/6" not in piped.output, piped.output
    assert "reference log-probabilities of 6 packs" in piped.output
    terminal = Console(file=io.StringIO(), force_terminal=True, width=120)
    monkeypatch.setattr(prepack.cli, "_stderr", lambda: terminal)
    shown = _reference_logps(build, "--model", saved_model, "--out", tmp_path / "shown", "--device", "cpu")
    assert shown.exit_code == 0 and "reference log-probabilities" in terminal.file.getvalue()
    assert "6/6" in terminal.file.getvalue()
    terminal.file.truncate(0)
    quiet = _reference_logps(build, "--model", saved_model, "--out", tmp_path / "quiet", "--device", "cpu", "--quiet")
    assert quiet.exit_code == 0 and quiet.output == "" and terminal.file.getvalue() == ""
    assert _snapshot(tmp_path / "quiet") == _snapshot(tmp_path / "shown") == _snapshot(tmp_path / "piped")


# --- open_hf_dataset and the TRL recipe on stored values ----------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_open_hf_dataset_serves_packed_dataset_s_reference_values(build, reference):
    packed, hf = PackedDataset(build, reference=reference), open_hf_dataset(build, reference=reference)
    assert len(hf) == len(packed) == 6
    for index in range(len(packed)):
        values = np.asarray(hf[index]["reference_logps"])
        assert values.dtype == np.float64 and np.array_equal(values, packed[index]["reference_logps"]), index
        assert np.array_equal(hf[index]["input_ids"], packed[index]["input_ids"]), index
    # The collator makes the same batch of either's rows: reference_logps [P, 2] float64 among them.
    collate = PackedCollator.for_dataset(packed)
    rows = [0, 3, 5]
    ours, theirs = collate([packed[i] for i in rows]), collate([hf[i] for i in rows])
    assert ours.keys() == theirs.keys() and theirs["reference_logps"].dtype == torch.float64
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]) if torch.is_tensor(value) else value == theirs[key], key
    # datasets' numpy format would hand the values out as float32: the collator refuses them.
    with pytest.raises(UsageError, match="reference_logps are float32, not the stored float64"):
        collate([hf.with_format("numpy")[i] for i in rows])


@pytest.mark.parametrize("tampering", sorted(TAMPERING))
def test_open_hf_dataset_refuses_what_the_loader_refuses(build, reference, tmp_path, tampering):
    out = _tampered(build, reference, tmp_path / "values", tampering)
    with pytest.raises(FormatError, match=TAMPERING[tampering][2]):
        open_hf_dataset(build, reference=out, verify_checksums=True)


def _recipe(monkeypatch) -> dict:
    """examples/train_dpo_trl.py's names, the script run as a module (not as __main__: main() is not called)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))  # its `from tiny_model import ...`
    return runpy.run_path(str(EXAMPLES / "train_dpo_trl.py"))


def test_trl_recipe_on_stored_values_holds_no_reference_and_gives_the_loop_s_loss(build, reference, tmp_path, monkeypatch):
    recipe = _recipe(monkeypatch)
    args = argparse.Namespace(data=str(build), model=None, steps=1, batch_size=2, accumulation=1, lr=1e-3, workers=0,
                              reference=str(reference))
    stored = recipe["packed_dpo_trainer"](args, enable_packing(tiny_llama(0)), None, str(tmp_path / "stored"))
    in_loop = recipe["packed_dpo_trainer"](argparse.Namespace(**{**vars(args), "reference": None}),
                                          enable_packing(tiny_llama(0)), enable_packing(tiny_llama(1)).eval(),
                                          str(tmp_path / "in-loop"))
    def other_modules(trainer) -> list[str]:
        return [name for name, value in vars(trainer).items() if isinstance(value, torch.nn.Module) and value is not trainer.model]

    # No reference model anywhere on the trainer: the policy is its only module.
    assert stored.ref_model is None and other_modules(stored) == [] and other_modules(in_loop) == ["ref_model"]
    rows = [0, 1]
    batch = stored.data_collator([stored.train_dataset[i] for i in rows])
    plain = in_loop.data_collator([in_loop.train_dataset[i] for i in rows])
    assert "reference_logps" in batch and "reference_logps" not in plain
    with torch.no_grad():
        ours, looped = stored.compute_loss(stored.model, batch), in_loop.compute_loss(in_loop.model, plain)
    assert abs(looped.item() - np.log(2)) > 1e-3  # policy and reference differ: the reference counts
    torch.testing.assert_close(ours, looped, rtol=1e-12, atol=1e-12)
