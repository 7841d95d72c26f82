"""Reference log-probabilities computed once, stored beside a preference-pair build, and served with its packs.

    model = enable_packing(AutoModelForCausalLM.from_pretrained("./sft-model")).eval()
    write_reference_logps("pairs/", model, "pairs-reference/", batch_size=8)     # one pass, resumable
    dataset = PackedDataset("pairs/", reference="pairs-reference/")              # packs + reference_logps
    ...
    policy = pair_logps(model(**model_inputs(batch)).logits, batch)
    loss = dpo_loss(policy, stored_reference(batch), beta=0.1).mean()            # no reference forward

`write_reference_logps` runs the frozen model over every pack of the build, shard by shard, in the
build's order, and writes each document's summed completion log-probability (`sequence_logps`, float64)
as one file per build shard (`prepack.formats.reference`, `schemas/reference-logps.md`). Each file is
written whole under a temporary name and linked into place without replacing anything, then
`reference.json` is rewritten to list it: a run that stops leaves finished files listed, and the next
run into the same directory with the same build and model checks them (sha256, rows, documents per
pack, values) and computes only the rest, ending with the bytes an uninterrupted run writes. A directory
holding anything prepack does not write there, another build's values or another model's is refused.

This module imports torch; `import prepack` does not load it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any
from uuid import uuid4

import numpy as np
import pyarrow as pa

from prepack.errors import FormatError, InputError, OutputError, UsageError, optional_imports
from prepack.formats.common import list_array
from prepack.formats.reference import (
    REFERENCE_MANIFEST,
    REFERENCE_SCHEMA,
    ReferenceFile,
    ReferenceManifest,
    ReferenceModel,
    build_shard_documents,
    check_against_build,
    check_reference_file,
    open_reference_file,
    read_reference_manifest,
    reference_file_name,
)
from prepack.formats.shards import Manifest
from prepack.storage.files import write_record_batch
from prepack.storage.output import output_errors, output_lock
from prepack.training.collate import Layout, PackedCollator
from prepack.training.dataset import PackedDataset
from prepack.training.preference import PairLogps, model_inputs, sequence_logps, trained_tokens

with optional_imports("prepack.training.reference"):
    import torch

__all__ = ["describe_model", "stored_reference", "write_reference_logps"]

# What a run writes into a reference directory besides `reference.json`: finished files, and the
# temporary ones a stopped run leaves behind (deleted by the next run, under the lock).
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
) -> ReferenceManifest:
    """Compute, with the frozen `model` (in eval mode, ready for packed batches: `enable_packing`), every
    document's summed completion log-probability over the preference-pair build `build`, and write them
    into the directory `out` (see the module docstring); return its finished manifest.

    `batch_size` packs go through the model at once (`layout` as `PackedCollator`'s), never two shards'
    packs together. `out` is created, or taken up where a run with this build and model stopped.
    Raises InputError for a build without pairs, UsageError for a model in training mode, OutputError
    when `out` holds anything else, FormatError when a file listed there no longer checks."""
    if getattr(model, "training", False):
        raise UsageError("The reference model is in training mode (dropout would make its values random): call model.eval().")
    if batch_size < 1:
        raise UsageError(f"batch_size must be at least 1, not {batch_size}.")
    dataset = PackedDataset(build)
    manifest = dataset.manifest
    if manifest.pairs is None:
        raise InputError(f"{build} is not a preference-pair build (prepack build --pairs): it has no reference log-probabilities.")
    out = Path(out)
    if out.is_symlink() or out.name in ("", ".."):
        raise OutputError(f"{out} is a symbolic link or names no directory; give a directory path such as ./pairs-reference.")
    with output_errors(out.parent, "create"):
        out.parent.mkdir(parents=True, exist_ok=True)
    description = describe_model(model, name)
    with output_lock(out):
        reference = _started(out, manifest, description)
        collate = PackedCollator.for_dataset(dataset, layout=layout)
        first_pack = 0
        for index, info in enumerate(manifest.shards):
            documents = build_shard_documents(manifest, dataset.shard_paths[index], info)
            if index < len(reference.files):  # finished by an earlier run: checked, not computed
                listed = reference.files[index]
                batch = open_reference_file(out, listed, check_sha256=True)
                check_reference_file(batch, documents, str(out / listed.name))
            else:
                packs = range(first_pack, first_pack + info.rows)
                values = _shard_logps(dataset, collate, model, packs, batch_size)
                if not np.isfinite(values).all():
                    document = int(np.flatnonzero(~np.isfinite(values))[0])
                    pack = int(np.searchsorted(np.cumsum(documents), document, side="right"))
                    raise InputError(f"{description.name} gives document {document} of {info.name} (in its row {pack}) the "
                                     f"log-probability {values[document]}: a reference must give every trained token a finite one.")
                offsets = np.append(0, np.cumsum(documents))
                batch = pa.RecordBatch.from_arrays([list_array(offsets, values)], schema=REFERENCE_SCHEMA)
                size, sha256 = _publish(out, index, batch)
                file = ReferenceFile(name=reference_file_name(index), shard_sha256=info.sha256, rows=info.rows,
                                     bytes=size, sha256=sha256)
                reference = reference.model_copy(update={"files": [*reference.files, file]})
                _write_manifest(out, reference)
            first_pack += info.rows
    return reference


def _shard_logps(dataset: PackedDataset, collate: PackedCollator, model: Any, packs: range, batch_size: int) -> np.ndarray:
    """Every document's summed log-probability over `packs`, in pack and document order, float64."""
    device = next(model.parameters()).device
    values = []
    for start in range(packs.start, packs.stop, batch_size):
        batch = collate([dataset[i] for i in range(start, min(start + batch_size, packs.stop))])
        batch = {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
        with torch.no_grad():
            sums, _ = sequence_logps(model(**model_inputs(batch)).logits, batch)
        # Every pack holds whole pairs, in document order: pair_segments, flattened, are its documents.
        values.append(sums[batch["pair_segments"].reshape(-1)].to("cpu", torch.float64).numpy())
    return np.concatenate(values) if values else np.zeros(0, np.float64)


def _started(out: Path, build: Manifest, model: ReferenceModel) -> ReferenceManifest:
    """The manifest to go on from: a new one in a new or empty directory, else the one there, when it is
    of this build and model and the directory holds nothing prepack does not write there. Temporary
    files of a stopped run are deleted (the caller holds the lock)."""
    fresh = ReferenceManifest(build_fingerprint=build.fingerprint, shards=len(build.shards), model=model, files=[])
    with output_errors(out, "create"):
        out.mkdir(exist_ok=True)
    if not out.is_dir() or out.is_symlink():
        raise OutputError(f"{out} is not a directory.")
    with output_errors(out, "read"):
        names = sorted(os.listdir(out))
    if not names:
        _write_manifest(out, fresh)
        return fresh
    refusal = f"{out} is not a directory of reference log-probabilities prepack can go on writing"
    foreign = [n for n in names if n != REFERENCE_MANIFEST and not (_FINISHED.fullmatch(n) or _TEMPORARY.fullmatch(n))]
    if foreign or REFERENCE_MANIFEST not in names:
        what = f"it holds {', '.join(foreign)}" if foreign else f"it holds files but no {REFERENCE_MANIFEST}"
        raise OutputError(f"{refusal}: {what}, which prepack did not write; choose another directory.")
    try:
        found = read_reference_manifest(out)
        check_against_build(found, build, out / REFERENCE_MANIFEST)
    except FormatError as exc:
        raise OutputError(f"{refusal}: {exc}") from None
    if (found.model.config_sha256, found.model.weights_sha256) != (model.config_sha256, model.weights_sha256):
        raise OutputError(f"{refusal}: its values are of the model {found.model.model_dump()}, not of this one "
                          f"{model.model_dump()}; choose another directory.")
    with output_errors(out, "delete"):
        for temporary in (n for n in names if _TEMPORARY.fullmatch(n)):
            (out / temporary).unlink()
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


def stored_reference(batch: dict[str, Any]) -> PairLogps:
    """The reference `PairLogps` of a batch collated from a `PackedDataset(..., reference=DIR)`: the stored
    values (`batch["reference_logps"]`, [P, 2]) and each completion's trained tokens, from the labels."""
    if "reference_logps" not in batch:
        raise UsageError("stored_reference needs reference_logps: open the build as PackedDataset(build, reference=DIR).")
    values = batch["reference_logps"]
    if "shared_prompt_ids" in batch:  # PackedCollator(shared_prompt=True): no segments, each pair's parts
        from prepack.training.shared_prompt import shared_trained_tokens

        tokens = shared_trained_tokens(batch).to(values.device)
    else:
        tokens = trained_tokens(batch)[batch["pair_segments"].to(values.device)]
    return PairLogps(values[:, 0], values[:, 1], tokens[:, 0].to(values.device), tokens[:, 1].to(values.device))
