"""Reference log-probabilities computed once, stored beside a preference-pair build, and served with its packs.

    model = enable_packing(AutoModelForCausalLM.from_pretrained("./sft-model")).eval()
    write_reference_logps("pairs/", model, "pairs-reference/", batch_size=8)     # one pass, resumable
    dataset = PackedDataset("pairs/", reference="pairs-reference/")              # packs + reference_logps
    ...
    policy = pair_logps(model(**model_inputs(batch)).logits, batch)
    loss = dpo_loss(policy, stored_reference(batch), beta=0.1).mean()            # no reference forward

`write_reference_logps` runs the frozen model over every pack of the build, shard by shard, in the
build's order, and writes each document's summed completion log-probability (`sequence_logps`, float64)
as one file per build shard (`prepack.formats.reference`, `schemas/reference-logps.md`). The directory
appears whole, in one rename, when every value is computed, or not at all: the files are written into a
hidden staging directory beside it (`prepack.storage.output.resumable_staging`), each whole under a
temporary name and linked into place without replacing anything, then `reference.json` rewritten to list
it. A run that stops keeps that staging directory when it finished a file, and the next run to the same
directory with the same build and model checks those files (sha256, rows, documents per pack, values) and
computes only the rest, ending with the bytes an uninterrupted run writes. A directory that exists is taken
only when it holds this build's and model's finished values (checked, none computed); anything else there is
refused, never replaced.

This module imports torch; `import prepack` does not load it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from uuid import uuid4

import numpy as np
import pyarrow as pa

from prepack.building.build import progress_bars
from prepack.errors import FormatError, InputError, OutputError, PrepackError, UsageError, optional_imports
from prepack.formats.common import FormatProblem, first_index, list_array, list_column
from prepack.formats.reference import (
    REFERENCE_MANIFEST,
    REFERENCE_SCHEMA,
    ReferenceFile,
    ReferenceManifest,
    ReferenceModel,
    build_shard_documents,
    read_reference_file,
    read_reference_manifest,
    reference_file_name,
    unfinished,
)
from prepack.formats.shards import Manifest
from prepack.storage.files import write_record_batch
from prepack.storage.output import output_errors, output_lock, resumable_staging
from prepack.training.collate import Layout, PackedCollator
from prepack.training.dataset import PackedDataset
from prepack.training.preference import GroupLogps, PairLogps, model_inputs, sequence_logps, trained_tokens

with optional_imports("prepack.training.reference"):
    import torch

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["describe_model", "stored_group_reference", "stored_reference", "write_reference_logps"]

# What a run writes into a reference directory besides `reference.json`: finished files, and the
# temporary ones a killed run leaves behind in its staging directory (deleted by the next run, under the lock).
_FINISHED = re.compile(r"reference-\d{5,}\.arrow")
_TEMPORARY = re.compile(r"\.reference-\d{5,}\.arrow\.tmp-[0-9a-f]{8}|\.reference\.json\.tmp")


def describe_model(model: Any, name: str | None = None) -> ReferenceModel:
    """The model's `ReferenceModel`: `name` (default: its config's `name_or_path`, else its class name), the
    sha256 of its config as JSON (where it was loaded from left out: the same model from another path is
    the same model), and the sha256 of its weights (every state_dict tensor's name, dtype, shape and
    bytes, in key order: one read of the weights, copied to the CPU a tensor at a time)."""
    config = getattr(model, "config", None)
    fields = config.to_dict() if hasattr(config, "to_dict") else None
    config_text = "" if fields is None else json.dumps({k: v for k, v in fields.items() if k != "_name_or_path"}, sort_keys=True)
    weights = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        weights.update(f"{key}\0{flat.dtype}\0{tuple(tensor.shape)}\0".encode())
        weights.update(flat.view(torch.uint8).numpy())
    return ReferenceModel(
        name=name or getattr(config, "name_or_path", "") or type(model).__name__,
        config_sha256=hashlib.sha256(config_text.encode()).hexdigest(),
        weights_sha256=weights.hexdigest(),
    )


def write_reference_logps(
    build: str | os.PathLike,
    model: Any,
    out: str | os.PathLike,
    *,
    batch_size: int = 8,
    name: str | None = None,
    layout: Layout = "padded",
    progress: bool = False,
    console: Console | None = None,
) -> ReferenceManifest:
    """Compute, with the frozen `model` (in eval mode, ready for packed batches: `enable_packing`), every
    document's summed completion log-probability over the preference-pair build `build`, and write them
    into the directory `out` (see the module docstring); return its finished manifest.

    `batch_size` packs go through the model at once (`layout` as `PackedCollator`'s), never two shards'
    packs together; with `progress`, a bar of the packs done on `console` (stderr when None). Raises
    InputError for a build without pairs, a build holding a token id past the model's vocabulary (before the
    model runs), and a model that fails on a batch or gives no finite value; UsageError for a model in
    training mode or on the meta device; OutputError when `out` exists and does not hold this build's and
    model's finished values; FormatError when a file listed there no longer checks."""
    if getattr(model, "training", False):
        raise UsageError("The reference model is in training mode (dropout would make its values random): call model.eval().")
    if any(parameter.is_meta for parameter in model.parameters()):
        raise UsageError("The reference model's weights are on the meta device (shapes without values): load them first.")
    if batch_size < 1:
        raise UsageError(f"batch_size must be at least 1, not {batch_size}.")
    dataset = PackedDataset(build)
    manifest = dataset.manifest
    if manifest.pairs is None:
        raise InputError(f"{build} is not a preference-pair, group or unpaired build (prepack build --pairs, --groups, --unpaired): it has no reference log-probabilities.")
    description = describe_model(model, name)
    out = Path(out)
    if out.is_symlink() or out.name in ("", ".."):
        raise OutputError(f"{out} is a symbolic link or names no directory; give a directory path such as ./pairs-reference.")
    with output_errors(out.parent, "create"):
        out.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out), progress_bars(progress, console) as bar:
        task = bar.add_task("reference log-probabilities", total=len(dataset))
        if os.path.lexists(out):
            reference = _held(out, manifest, description)
            if not reference.complete:
                raise OutputError(f"{out / REFERENCE_MANIFEST} {unfinished(reference)}; prepack will not write into it: "
                                  "choose a new directory.")
            _check_listed(out, reference, dataset)
            bar.update(task, completed=len(dataset))
            return reference
        with resumable_staging(out, lambda directory: _stopped_run(directory, dataset, description)) as (directory, found):
            reference = found or ReferenceManifest(build_fingerprint=manifest.fingerprint, shards=len(manifest.shards),
                                                   model=description, files=[])
            _check_token_ids(dataset, model, description.name, first_shard=len(reference.files))
            first_pack = sum(info.rows for info in manifest.shards[: len(reference.files)])
            bar.update(task, completed=first_pack)
            collate = PackedCollator.for_dataset(dataset, layout=layout)
            for index in range(len(reference.files), len(manifest.shards)):
                info = manifest.shards[index]
                documents = build_shard_documents(manifest, dataset.shard_paths[index], info)
                packs = range(first_pack, first_pack + info.rows)
                values = _shard_logps(dataset, collate, model, packs, batch_size, description.name,
                                      lambda done: bar.advance(task, done))
                if not np.isfinite(values).all():
                    document = int(np.flatnonzero(~np.isfinite(values))[0])
                    pack = int(np.searchsorted(np.cumsum(documents), document, side="right"))
                    raise InputError(f"{description.name} gives document {document} of {info.name} (in its row {pack}) the "
                                     f"log-probability {values[document]}: a reference must give every trained token a finite one.")
                offsets = np.append(0, np.cumsum(documents))
                batch = pa.RecordBatch.from_arrays([list_array(offsets, values)], schema=REFERENCE_SCHEMA)
                size, sha256 = _publish(directory, index, batch)
                file = ReferenceFile(name=reference_file_name(index), shard_sha256=info.sha256, rows=info.rows,
                                     bytes=size, sha256=sha256)
                reference = reference.model_copy(update={"files": [*reference.files, file]})
                _write_manifest(directory, reference)
                first_pack += info.rows
            _write_manifest(directory, reference)  # a build of no shard has no file to list
    return reference


def _vocabulary_size(model: Any) -> int | None:
    """The token ids `model` takes: the fewer of its input embeddings' and its output layer's rows, where
    it has them (None for a module that has neither: its own forward is then what refuses an id)."""
    sizes = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            layer = getattr(model, getter, lambda: None)()
        except (NotImplementedError, AttributeError):  # transformers' default for a model without such a layer
            layer = None
        weight = getattr(layer, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            sizes.append(int(weight.shape[0]))
    return min(sizes, default=None)


def _check_token_ids(dataset: PackedDataset, model: Any, name: str, first_shard: int = 0) -> None:
    """Refuse (InputError naming the shard, row and column) a build holding, from shard `first_shard` on (those
    still to compute), a token id the model's vocabulary lacks, before it runs: its embedding would fail on it,
    or read another table's row."""
    vocabulary = _vocabulary_size(model)
    if vocabulary is None:
        return
    manifest = dataset.manifest
    for path, info in zip(dataset.shard_paths[first_shard:], manifest.shards[first_shard:]):
        batch = manifest.open_shard(path)
        for column in ("input_ids", "labels") if manifest.has_labels else ("input_ids",):
            offsets, values = list_column(batch, column, info.name)
            if len(values) and (beyond := values >= vocabulary).any():
                at = first_index(beyond)
                row = int(np.searchsorted(offsets, at, side="right")) - 1
                raise InputError(str(FormatProblem(str(path), (
                    f"holds token id {int(values[at])}; the reference model {name} has {vocabulary} ids in its vocabulary "
                    "(its embeddings' rows): was the build tokenized with this model's tokenizer?"), row, column)))


def _shard_logps(dataset: PackedDataset, collate: PackedCollator, model: Any, packs: range, batch_size: int, name: str,
                 advance: Callable[[int], object]) -> np.ndarray:
    """Every document's summed log-probability over `packs`, in pack and document order, float64; `advance`
    is called with the packs of each batch done. The model's own failure on a batch is an InputError naming it."""
    device = next(model.parameters()).device
    values = []
    for start in range(packs.start, packs.stop, batch_size):
        stop = min(start + batch_size, packs.stop)
        batch = collate([dataset[i] for i in range(start, stop)])
        batch = {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
        try:
            with torch.no_grad():
                logits = model(**model_inputs(batch)).logits
        except PrepackError:
            raise
        except Exception as exc:  # noqa: BLE001 (the model's own code fails in any way)
            first_line = str(exc).strip().partition("\n")[0]
            raise InputError(f"{name} fails on packs {start} to {stop - 1} of the build: {type(exc).__name__}: {first_line}") from exc
        sums, _ = sequence_logps(logits, batch)
        # Every pack holds whole pairs, in document order: pair_segments, flattened, are its documents.
        values.append(sums[batch["pair_segments"].reshape(-1)].to("cpu", torch.float64).numpy())
        advance(stop - start)
    return np.concatenate(values) if values else np.zeros(0, np.float64)


def _held(directory: Path, build: Manifest, model: ReferenceModel) -> ReferenceManifest:
    """The manifest of `directory` when it holds reference values of `build` and `model` (finished or not)
    and nothing prepack does not write there, else OutputError saying what it holds."""
    refusal = f"{directory} already exists and is not a directory of this build's reference log-probabilities by this model"
    if not directory.is_dir() or directory.is_symlink():
        raise OutputError(f"{refusal}: it is not a directory; choose another path.")
    with output_errors(directory, "read"):
        names = sorted(os.listdir(directory))
    if not names:
        raise OutputError(f"{refusal}: it is empty. Give a new path: the directory appears when every value is computed.")
    foreign = [n for n in names if n != REFERENCE_MANIFEST and not (_FINISHED.fullmatch(n) or _TEMPORARY.fullmatch(n))]
    if foreign or REFERENCE_MANIFEST not in names:
        what = f"it holds {', '.join(foreign)}" if foreign else f"it holds files but no {REFERENCE_MANIFEST}"
        raise OutputError(f"{refusal}: {what}, which prepack did not write; choose another directory.")
    try:
        found = read_reference_manifest(directory, build)
    except FormatError as exc:
        raise OutputError(f"{refusal}: {exc}") from None
    if (found.model.config_sha256, found.model.weights_sha256) != (model.config_sha256, model.weights_sha256):
        raise OutputError(f"{refusal}: its values are of the model {found.model.model_dump()}, not of this one "
                          f"{model.model_dump()}; choose another directory.")
    return found


def _check_listed(directory: Path, reference: ReferenceManifest, dataset: PackedDataset) -> None:
    """Check each file `reference` lists (sha256, and as the loader does) against the build: FormatError."""
    manifest = dataset.manifest
    for index, listed in enumerate(reference.files):
        documents = functools.partial(build_shard_documents, manifest, dataset.shard_paths[index], manifest.shards[index])
        read_reference_file(directory, listed, documents, check_sha256=True)


def _stopped_run(directory: Path, dataset: PackedDataset, model: ReferenceModel) -> ReferenceManifest | None:
    """The manifest to go on from in a stopped run's staging `directory`: when it holds values of this build
    and model, every listed file checks, and nothing else is there but finished and temporary files (the
    temporary ones are deleted: the caller holds the lock). None otherwise: the caller deletes it."""
    try:
        found = _held(directory, dataset.manifest, model)
        _check_listed(directory, found, dataset)
    except (OutputError, FormatError):
        return None
    with output_errors(directory, "delete"):
        for temporary in (n for n in os.listdir(directory) if _TEMPORARY.fullmatch(n)):
            (directory / temporary).unlink()
    return found


def _publish(out: Path, index: int, batch: pa.RecordBatch) -> tuple[int, str]:
    """Write `batch` as shard `index`'s file (its size and sha256): whole under a temporary name, then linked to its name, which
    replaces nothing. A file already there (a stopped run wrote it, then stopped before listing it) is
    taken when it holds exactly these bytes, else refused."""
    name = reference_file_name(index)
    final, temporary = out / name, out / f".{name}.tmp-{uuid4().hex[:8]}"
    try:
        size, sha256 = write_record_batch(temporary, batch)
        try:
            os.link(temporary, final)
        except FileExistsError:
            with output_errors(final, "read"):
                found = hashlib.sha256(final.read_bytes()).hexdigest()
            if found != sha256:
                raise OutputError(f"{final} exists, is not listed in {REFERENCE_MANIFEST}, and does not hold the values "
                                  "this run computed; prepack will not replace it (delete it to compute it again).") from None
        except OSError as exc:
            raise OutputError(f"cannot create {final}: {exc.strerror}.") from exc
    finally:
        with output_errors(temporary, "delete"):
            temporary.unlink(missing_ok=True)
    return size, sha256


def _write_manifest(out: Path, manifest: ReferenceManifest) -> None:
    """Write `reference.json` atomically (temporary file, synced, renamed over the last one), keys sorted."""
    text = json.dumps(manifest.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
    temporary = out / f".{REFERENCE_MANIFEST}.tmp"
    with output_errors(temporary):
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, out / REFERENCE_MANIFEST)


def stored_group_reference(batch: dict[str, Any]) -> GroupLogps:
    """The reference `GroupLogps` [P, G] of a batch collated from a `PackedDataset(..., reference=DIR)` of a
    pair or group build: the stored values (`batch["reference_logps"]`) and each completion's trained tokens,
    from the labels."""
    if "reference_logps" not in batch:
        raise UsageError("The batch has no reference_logps to take the stored reference from: open the build as "
                         "PackedDataset(build, reference=DIR).")
    values = batch["reference_logps"]
    if "shared_prompt_ids" in batch:  # PackedCollator(shared_prompt=True): no segments, each group's parts
        from prepack.training.shared_prompt import shared_trained_tokens

        tokens = shared_trained_tokens(batch).to(values.device)
    else:
        tokens = trained_tokens(batch)[batch["pair_segments"].to(values.device)]
    return GroupLogps(values, tokens.to(values.device))


def stored_reference(batch: dict[str, Any]) -> PairLogps:
    """The reference `PairLogps` of a batch of pairs collated from a `PackedDataset(..., reference=DIR)`
    (`stored_group_reference`, of 2)."""
    values, tokens = stored_group_reference(batch)
    if values.shape[1] != 2:
        raise UsageError(f"stored_reference takes a batch of pairs, not of groups of {values.shape[1]}: use stored_group_reference.")
    return PairLogps(values[:, 0], values[:, 1], tokens[:, 0], tokens[:, 1])
