"""The OLMo-core export, read back by ai2-olmo-core 3.0.0's own classes, equals what prepack trains on:
`NumpyFSLDataset` serves instance p = pack p (tokens, then padding) and its label mask gives, through
OLMo-core's `get_labels`, prepack's targets; the Dolma metadata, read by `iter_document_indices`, gives
every pack's document boundaries; and `NumpyPackedFSLDataset`, which packs the documents again, keeps
each one whole with its label mask and exact `doc_lens`."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from prepack.errors import InputError
from prepack.exports import export_build, olmo_core, verify_export
from tests.cli import invoke_prepack
from tests.corpus import preference_pairs
from tests.exports.rows import Expected
from tests.exports.trainer_builds import GPT2_EOS, KINDS, files, labelled_corpus_build

UNUSED_ID = 2**31 - 1  # the EOS and padding OLMo-core's readers are given: no token of a build has this id


def export(build_dir: Path, out: Path) -> Path:
    export_build(build_dir, "olmo-core", out)
    return out


def fsl_mismatches(out: Path, expected: Expected) -> list[str]:
    """Where OLMo-core's NumpyFSLDataset (with the label mask) and the metadata's document boundaries
    differ from the build."""
    from olmo_core.data.numpy_dataset import NumpyFSLDataset
    from olmo_core.data.utils import get_labels, iter_document_indices

    max_len = expected.manifest.options.max_len
    dataset = NumpyFSLDataset(
        str(out / olmo_core.TOKENS), sequence_length=max_len, pad_token_id=olmo_core.PAD_TOKEN_ID,
        eos_token_id=UNUSED_ID, vocab_size=UNUSED_ID + 1, dtype=np.uint32,
        label_mask_paths=[str(out / olmo_core.LABEL_MASK)],
    )
    documents = np.array(list(iter_document_indices(str(out / olmo_core.TOKENS), use_array_if_local=False,
                                                    dtype=np.uint32)), np.int64).reshape(-1, 2)
    if len(dataset) != len(expected):
        return [f"{len(dataset)} instances for {len(expected)} packs"]
    problems = []
    for p in range(len(expected)):
        instance, ids, cu = dataset[p], expected.ids(p), expected.cu_seqlens(p)
        n = len(ids)
        labels = get_labels({"input_ids": instance["input_ids"][None], "label_mask": instance["label_mask"][None]})[0]
        # OLMo-core's labels are shifted (position t predicts t + 1): prepack's targets from the second token on
        targets = np.concatenate([expected.targets(p)[1:], np.full(max_len - n + 1, -100)])
        own = documents[(documents[:, 0] >= p * max_len) & (documents[:, 0] < (p + 1) * max_len)] - p * max_len
        if not (np.array_equal(instance["input_ids"][:n].numpy(), ids) and (instance["input_ids"][n:] == 0).all()):
            problems.append(f"pack {p}: tokens")
        elif not np.array_equal(labels.numpy(), targets):
            problems.append(f"pack {p}: label mask")
        elif not len(own) or not np.array_equal(np.append(own[:, 0], own[-1, 1]), cu):
            problems.append(f"pack {p}: document boundaries")
        elif (own[1:, 0] != own[:-1, 1]).any():  # a gap or an overlap between two documents
            problems.append(f"pack {p}: document boundaries")
    return problems


@pytest.fixture(scope="module", params=KINDS)
def exported(request, builds, tmp_path_factory) -> tuple[Path, Path]:
    build_dir = builds[request.param]
    return build_dir, export(build_dir, tmp_path_factory.mktemp("olmo-core") / "out")


@pytest.mark.slow
def test_fsl_instances_are_the_packs_with_their_labels_and_boundaries(exported):
    build_dir, out = exported
    expected = Expected(build_dir)
    assert fsl_mismatches(out, expected) == []
    if expected.manifest.mixture is not None:  # the metadata's third field
        with gzip.open(out / olmo_core.DOCUMENTS, "rt") as lines:
            sources = [int(line.split(",")[2]) for line in lines]
        assert sources == np.concatenate([expected.source_ids(p) for p in range(len(expected))]).tolist()


@pytest.mark.slow
def test_olmo_core_packing_again_keeps_every_document_and_its_mask(exported, tmp_path):
    from olmo_core.data.numpy_dataset import NumpyPackedFSLDataset

    build_dir, out = exported
    expected = Expected(build_dir)
    dataset = NumpyPackedFSLDataset(
        str(out / olmo_core.TOKENS), sequence_length=expected.manifest.options.max_len, pad_token_id=UNUSED_ID,
        eos_token_id=UNUSED_ID - 1, vocab_size=UNUSED_ID + 1, dtype=np.uint32, generate_doc_lengths=True,
        label_mask_paths=[str(out / olmo_core.LABEL_MASK)], use_array_if_local=False,
    )
    dataset.work_dir = tmp_path
    dataset.prepare()
    found = Counter()
    for i in range(len(dataset)):
        instance = dataset[i]
        real = int((instance["input_ids"] != UNUSED_ID).sum())
        bounds = torch.cumsum(instance["doc_lens"], 0).tolist()
        assert real in bounds  # the padding is a segment of its own
        starts = [0, *bounds]
        for s, e in zip(starts, bounds[: bounds.index(real) + 1]):
            found[(tuple(instance["input_ids"][s:e].tolist()), tuple(instance["label_mask"][s:e].tolist()))] += 1
    want = Counter()
    for p in range(len(expected)):
        cu, ids, trained = expected.cu_seqlens(p), expected.ids(p), expected.targets(p) != -100
        for s, e in zip(cu[:-1], cu[1:]):
            want[(tuple(ids[s:e].tolist()), tuple(trained[s:e].tolist()))] += 1
    assert found == want


@pytest.mark.slow
def test_fsl_doc_lens_found_by_eos_are_the_boundaries_of_a_text_build_tokenized_with_eos(builds, tmp_path):
    # docs/exports.md: NumpyFSLDataset's own doc_lens (an EOS scan) are exact where every document ends
    # with the EOS and holds no other; the padding is one segment more
    from olmo_core.data.numpy_dataset import NumpyFSLDataset

    build_dir = builds["text"]
    expected = Expected(build_dir)
    max_len = expected.manifest.options.max_len
    out = export(build_dir, tmp_path / "out")
    dataset = NumpyFSLDataset(
        str(out / olmo_core.TOKENS), sequence_length=max_len, pad_token_id=olmo_core.PAD_TOKEN_ID,
        eos_token_id=GPT2_EOS, vocab_size=GPT2_EOS + 1, dtype=np.uint32, generate_doc_lengths=True,
    )
    assert any(len(expected.cu_seqlens(p)) > 2 for p in range(len(expected)))
    for p in range(len(expected)):
        lengths = np.diff(expected.cu_seqlens(p))
        padding = max_len - lengths.sum()
        assert dataset[p]["doc_lens"].tolist() == lengths.tolist() + ([padding] if padding else [])


@pytest.mark.slow
def test_the_comparison_sees_a_changed_label_mask_token_or_boundary(builds, tmp_path):
    build_dir = builds["chat"]
    expected = Expected(build_dir)
    out = export(build_dir, tmp_path / "out")
    mask = np.fromfile(out / olmo_core.LABEL_MASK, np.bool_)
    mask[np.flatnonzero(mask)[0]] = False
    mask.tofile(out / olmo_core.LABEL_MASK)
    assert fsl_mismatches(out, expected) == ["pack 0: label mask"]

    out = export(build_dir, tmp_path / "again")
    tokens = np.fromfile(out / olmo_core.TOKENS, np.uint32)
    tokens[3] += 1
    tokens.tofile(out / olmo_core.TOKENS)
    assert fsl_mismatches(out, expected) == ["pack 0: tokens"]

    out = export(build_dir, tmp_path / "third")
    with gzip.open(out / olmo_core.DOCUMENTS, "rt") as lines:
        documents = [list(map(int, line.split(","))) for line in lines]
    p = next(p for p in range(len(expected)) if len(expected.cu_seqlens(p)) > 2)
    first = sum(len(expected.cu_seqlens(q)) - 1 for q in range(p))
    documents[first][1] -= 1  # pack p's first document ends a token early, its second starts a token early
    documents[first + 1][0] -= 1
    (out / olmo_core.DOCUMENTS).write_bytes(gzip.compress("".join(f"{s},{e}\n" for s, e in documents).encode()))
    assert fsl_mismatches(out, expected) == [f"pack {p}: document boundaries"]


@pytest.mark.slow
def test_a_rerun_writes_the_same_bytes(builds, tmp_path):
    build_dir = builds["mixture"]
    assert files(export(build_dir, tmp_path / "a")) == files(export(build_dir, tmp_path / "b"))


def test_labels_other_than_the_token_ids_are_refused(tmp_path):
    build_dir = labelled_corpus_build(tmp_path, lambda doc: [-100, -100] + [t * 2 for t in doc[2:]])
    with pytest.raises(InputError, match=r"Pack \d+, token \d+, column .labels.*OLMo-core export.*token id"):
        export(build_dir, tmp_path / "out")


@pytest.mark.slow
def test_a_preference_pair_build_is_refused_by_name(tmp_path):
    with pytest.raises(InputError, match="preference-pair build.*OLMo-core"):
        export(preference_pairs(tmp_path), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_command_line_exports_and_verifies(builds, tmp_path):
    build_dir, out = builds["mixture"], tmp_path / "export"
    result = invoke_prepack("export", str(build_dir), "--to", "olmo-core", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert fsl_mismatches(out, Expected(build_dir)) == []
    record = json.loads((out / "export.json").read_text())
    assert record["format"] == "olmo-core" and record["build"]["kind"] == "mixture full"
    assert [f["path"] for f in record["files"]] == [olmo_core.LABEL_MASK, olmo_core.DOCUMENTS, olmo_core.TOKENS]
    checked = invoke_prepack("verify", str(build_dir), "--export", str(out))
    assert checked.returncode == 0 and "the export's files and build checked" in checked.stdout
    tokens = np.fromfile(out / olmo_core.TOKENS, np.uint32)
    tokens[0] += 1
    tokens.tofile(out / olmo_core.TOKENS)
    (problem,) = verify_export(out, build_dir)
    assert problem.startswith(f"{out / olmo_core.TOKENS}: sha256 ") and problem.endswith("the file changed.")
    tampered = invoke_prepack("verify", str(build_dir), "--export", str(out))
    assert tampered.returncode == 1 and olmo_core.TOKENS in tampered.stdout and "the file changed" in tampered.stdout
