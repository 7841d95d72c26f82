"""Golden bytes: a tiny deterministic build whose files' sha256s are pinned, so that any change to what
prepack writes (the shard format, the manifest's fields or their values, the packing plan) fails here.

If a change here is intended: bump FORMAT_VERSION when readers of the old bytes would misread the new
ones, or else record it in the changelog of schemas/shard-format.md; then update GOLDEN (the only place
the pinned values live) with the values the failure prints.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from prepack import build, build_store
from prepack.formats.shards import FORMAT_VERSION
from tests.corpus import corpus_table, write_corpus

# Every pinned value. The manifest is hashed with its prepack_version blanked (a release changes it, not
# the format); its field names are pinned too, so that a new field fails with its name.
GOLDEN = {
    "format_version": 2,
    "manifest_fields": [
        "fingerprint",
        "format_version",
        "has_labels",
        "inputs",
        "inputs[].path",
        "inputs[].rows",
        "options",
        "options.algorithm",
        "options.column",
        "options.drop_untrained",
        "options.labels_column",
        "options.max_len",
        "options.overflow",
        "options.seed",
        "options.shard_size",
        "options.tokenize",
        "prepack_version",
        "shards",
        "shards[].bytes",
        "shards[].name",
        "shards[].rows",
        "shards[].sha256",
        "shards[].tokens",
        "totals",
        "totals.documents",
        "totals.dropped",
        "totals.dropped_tokens",
        "totals.empty",
        "totals.input_tokens",
        "totals.lower_bound",
        "totals.packs",
        "totals.padding_tokens",
        "totals.segments",
        "totals.split",
        "totals.split_pieces",
        "totals.tokens",
        "totals.truncated",
        "totals.truncated_tokens",
        "totals.untrained",
        "totals.untrained_tokens",
    ],
    "plain": {
        "manifest": "3b0b2017334c2b9325a415a0f15d91cee1c7b4b0ce031c27e551a62192f90b11",
        "shards": [
            "0c68e57ec16576902afa49f452802ceb096fcf1c05b2d1d7d8c3ba3985119202",
            "a23d2ef5cf07f0ffe44771c1736341ae4951fcf33183fe5bab3dd90843213b4f",
            "a98abfce4aeb55f7a155a4fd55cad3a497529d4ed85bfb7307f0106ae41f6af5",
            "c60549acd0f1aba4c08b9517718e7812d6f36b566a9beca2e3eeba80201e0794",
            "dedcaef7d0fa16df5c986c41f6d48f2f8e04ef9b1114fc55a09e686029cf7da0",
        ],
    },
    "labelled": {
        "manifest": "4c9249372653073245794849090ba559150131fd87b3b1a5644dfa656b9e4e30",
        "shards": [
            "971a255acba757a01e837b20ee18ef19ea8926652693de179bba629f567efb39",
            "d30f2bbf8195ec260c9f9566727127566085425cd6434310f8ada766bc6704c9",
            "31442ee3451a50bbc1f18add62a16432820fe2504fd6e856d5bd6ea88893f8da",
            "f547db2820c77d4258ad09d13a015ab5abd835b3bf485ffa82bbb7993b586337",
            "b8e19a67c847c7ebcac857c622804f32371b4ac15086136634391483622b910e",
            "84dd5666c2507a40def09dbb66e8ec97d0190e590b0befe3bef06ce19228522f",
        ],
    },
    # The labelled corpus's store, built with the labelled build's options and --index-only. Changed
    # deliberately when index shards began to carry their store's fingerprint, and its manifest when builds
    # of a store began to record their segment lengths (shard-format.md changelog).
    "index": {
        "manifest": "1e5ecc84b41ee79985de32abf7f743a63b0253f889b97609aa61e1545601b009",
        "shards": [
            "6c41f542b187571a16dc014fe7da1c8065789d9c751aa2d0725d4f7b1f3d52b0",
            "af3ba9a0578135036641eecd2799816acb400396241cb0776c2fdc4343e336d1",
            "376a892a6f9d88ecf6e10776013e64f635f5ee7dfbecf869dd123b9f18d9d041",
        ],
    },
    # MIXTURE of the plain corpus (weighted, upsampled) and the labelled store (in epochs), --overflow
    # truncate: selection by whole documents. Recorded at 273db52, before mixtures selected by pieces
    # (--overflow split) and read their sources twice; those left such a build's bytes as they were.
    "mixture": {
        "manifest": "e527bd89cb1b7aba20462dcab9e42a84e0ff46a5a7cc7935d2cf48262fc16f95",
        "shards": [
            "de5c4a853bbdae355d4f23bddec3ed57f64c5f1c8297f816bf07a89ee5d5bb13",
            "5f4c72ea5ff6447d740e8b6d89b1fe987c25027c4a94781fe6025c9167eb76b9",
            "64ea50a2a7bd7f6747264db9793e74853cb5bb6bdfb2076fdb7ab8f7b4c58507",
            "826ebf448b7a5d937c615ff04941b7a6efb577345435d036fd27125b9a7ab9df",
            "e80a107358c5339a8541d124723f55ced8c837f6437f97bc21b83048440ef881",
            "94050befd4bd4c20f3509746032480f2cd5c20063e7d4d80138daff0f27cc83d",
            "8c1a177bc4ddf041836369b473d8cddda07703519a958f1cd5cfa77b52bb6961",
            "0ab0ef0fd9bdfe4ad8f62ecc255392ebae268925059970fd787e8969f606d28e",
            "d2078c29244f9b2ae1133e0e807ede3ec65f3e0002c214b2e7daf7d1d2fa9260",
            "99805b14a2398ed4f3345ea7391c4be7e5098d4c00fd58a2b48505e6c61a161f",
            "10b28c4cf418180d811c3f7f4b615ecf1032e9a7c3e7a7f1f6bd99d8d2905f36",
            "6c0d933a20513e39333cd8495e346e3666265d8337e92dcb1e5c514dfc9c43dc",
            "0152a4002ebd78e1d8ef67fcd519e354bf26c4bc8c84796518b3995021135874",
            "b81f1c784aa21923da79f000141d3fb2f54018977123c365f9538feb234efc30",
        ],
    },
}

BUMP = (
    "the bytes prepack writes changed. If intended, bump FORMAT_VERSION (readers of the old bytes would "
    "misread the new ones) or justify it in the changelog of schemas/shard-format.md, then update GOLDEN "
    "in tests/formats/test_golden.py"
)

# Twelve documents of 0 to 11 tokens, one longer than max_len (split), one empty.
LENGTHS = [3, 5, 0, 8, 11, 2, 6, 1, 4, 7, 9, 5]
DOCUMENTS = [[(7 * row + 3 * i) % 50 for i in range(length)] for row, length in enumerate(LENGTHS)]
LABELS = [[-100 if i % 3 == 0 else token for i, token in enumerate(document)] for document in DOCUMENTS]
# Paths relative to the mixture file: a source's `path` is recorded as given.
MIXTURE = "tokens: 150\nseed: 2\nsources:\n  - {name: plain, path: plain.parquet, weight: 1}\n  - {name: labelled, path: store, epochs: 1.5}\n"


def _fields(value, prefix: str = "") -> list[str]:
    """Dotted names of every key in a JSON value (list items as `[]`)."""
    if isinstance(value, dict):
        return sorted({f for key, item in value.items() for f in (prefix + key, *_fields(item, f"{prefix}{key}."))})
    if isinstance(value, list):
        return sorted({f for item in value for f in _fields(item, prefix.rstrip(".") + "[].")})
    return []


@pytest.fixture(scope="module")
def golden_builds(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("golden")
    builds = {}
    for name, labels in (("plain", None), ("labelled", LABELS)):
        corpus = write_corpus(tmp / f"{name}.parquet", corpus_table(DOCUMENTS, labels))
        builds[name] = tmp / name
        build(corpus, builds[name], max_len=8, shard_size=200, seed=3)
    # The labelled corpus as a store, and its index build with the same options (`store.path` is
    # "../store": the bytes do not depend on where the two lie, only on where they lie to each other).
    build_store(tmp / "labelled.parquet", tmp / "store")
    builds["index"] = tmp / "index"
    build(tmp / "store", builds["index"], max_len=8, shard_size=200, seed=3, index_only=True)
    (tmp / "mix.yaml").write_text(MIXTURE)
    builds["mixture"] = tmp / "mixture"
    build(tmp / "mix.yaml", builds["mixture"], max_len=8, shard_size=200, seed=3, overflow="truncate")
    return builds


def _digests(out: Path) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    text = (out / "manifest.json").read_text().replace(
        f'"prepack_version": "{manifest["prepack_version"]}"', '"prepack_version": ""'
    )
    return {
        "manifest": hashlib.sha256(text.encode()).hexdigest(),
        "shards": [hashlib.sha256((out / s["name"]).read_bytes()).hexdigest() for s in manifest["shards"]],
    }


def test_golden_format_version():
    assert FORMAT_VERSION == GOLDEN["format_version"], BUMP


@pytest.mark.parametrize("name", ["plain", "labelled"])
def test_golden_manifest_fields(golden_builds, name):
    fields = _fields(json.loads((golden_builds[name] / "manifest.json").read_text()))
    pinned = GOLDEN["manifest_fields"]
    added, removed = sorted(set(fields) - set(pinned)), sorted(set(pinned) - set(fields))
    assert not added and not removed, f"manifest fields added {added}, removed {removed}: {BUMP}"


@pytest.mark.parametrize("name", ["plain", "labelled", "index", "mixture"])
def test_golden_bytes(golden_builds, name):
    found = _digests(golden_builds[name])
    assert len(found["shards"]) >= 2
    assert found == GOLDEN[name], f"{BUMP}: {name} is now {found}"


def test_golden_bytes_do_not_depend_on_the_run(golden_builds, tmp_path):
    corpus = write_corpus(tmp_path / "again.parquet", corpus_table(DOCUMENTS, LABELS))
    build(corpus, tmp_path / "again", max_len=8, shard_size=200, seed=3)
    again, first = _digests(tmp_path / "again"), _digests(golden_builds["labelled"])
    assert again["shards"] == first["shards"]
