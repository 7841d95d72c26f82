"""`verify` and `inspect` on a mixture build: both agree with the manifest on every per-source count,
and each catches a manifest or a shard that no longer does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

import prepack
from prepack.check.report import inspect_build
from prepack.check.verify import verify_build
from prepack.errors import FormatError, InputError
from tests.cli import WIDE, invoke_prepack, run_prepack
from tests.corpus import edit_json, mixture_sources, record_shard, write_mixture


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mixture-checks")
    mixture_sources(root)
    prepack.build(write_mixture(root), root / "packed", max_len=128)
    return root / "packed"


@pytest.fixture
def packed(clean, tmp_path) -> Path:
    """A copy of the mixture build to damage."""
    return shutil.copytree(clean, tmp_path / "packed")


def test_verify_and_inspect_agree_with_the_manifest(clean):
    assert verify_build(clean, all_problems=True) == []
    manifest = json.loads((clean / "manifest.json").read_text())
    report = inspect_build(clean)
    for said, shown in zip(manifest["mixture"]["sources"], report.sources, strict=True):
        assert shown.name == said["name"]
        for name in ("documents", "segments", "tokens", "requested_tokens", "full_epochs", "partial_documents"):
            assert getattr(shown, name) == said[name], name
        assert shown.weight == pytest.approx(said["weight_realized"])


def test_the_cli_shows_and_checks_the_sources(clean):
    shown = run_prepack("inspect", clean, env=WIDE)
    assert shown.returncode == 0, shown.stderr
    assert "sources (mixture)" in shown.stdout
    for line, source in zip(
        [line for line in shown.stdout.splitlines() if line.strip().startswith(("web ", "code ", "math "))],
        json.loads((clean / "manifest.json").read_text())["mixture"]["sources"],
        strict=True,
    ):
        assert line.split()[:3] == [source["name"], f"{source['requested_tokens']:,}", f"{source['tokens']:,}"]
    checked = invoke_prepack("verify", clean)
    assert checked.returncode == 0, checked.stderr
    assert "the counts of 3 sources" in checked.stdout


def test_a_source_count_the_packs_do_not_hold_is_found(packed):
    def more_tokens(raw: dict) -> None:
        raw["mixture"]["sources"][1]["tokens"] += 1

    edit_json(packed / "manifest.json", more_tokens)
    found = {p.column: p.message for p in verify_build(packed, all_problems=True)}
    assert "but the packs hold" in found["mixture.sources[1].tokens"]
    assert "but the sum over mixture.sources is" in found["totals.tokens"]
    with pytest.raises(FormatError, match="source 'code' has .* tokens, the shards hold"):
        inspect_build(packed)


def test_repeats_the_packs_do_not_show_are_found(packed):
    def fewer_partial(raw: dict) -> None:
        web = raw["mixture"]["sources"][0]
        web["partial_documents"] -= 1
        web["documents"] -= 1  # keeps the manifest's own arithmetic: only the packs can tell

    edit_json(packed / "manifest.json", fewer_partial)
    problems = [p for p in verify_build(packed, all_problems=True) if p.column == "mixture.sources[0]"]
    assert len(problems) == 1 and "1 full epochs" in problems[0].message


def test_a_wrong_source_id_is_found_at_its_pack(packed):
    manifest = json.loads((packed / "manifest.json").read_text())
    name = manifest["shards"][0]["name"]
    path = packed / name
    batch = pa.ipc.open_stream(path.read_bytes()).read_next_batch()
    ids = batch.column("source_ids").to_pylist()
    ids[2][0] = (ids[2][0] + 1) % 3
    field = batch.schema.field("source_ids")
    batch = batch.set_column(batch.schema.get_field_index("source_ids"), field, pa.array(ids, field.type))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    path.write_bytes(sink.getvalue().to_pybytes())
    record_shard(packed / "manifest.json", path)
    problems = verify_build(packed)
    assert [(p.file, p.row, p.column) for p in problems] == [(name, 2, "source_ids")]


def test_verify_source_is_refused_for_a_mixture(clean):
    with pytest.raises(InputError, match="a mixture of 3 sources: --source checks a build of one corpus"):
        verify_build(clean, clean.parent / "web.parquet")


def test_a_single_source_build_has_no_mixture_and_no_source_ids(clean, tmp_path):
    manifest = prepack.build(clean.parent / "web.parquet", tmp_path / "one", max_len=128)
    assert manifest.mixture is None
    assert "mixture" not in json.loads((tmp_path / "one" / "manifest.json").read_text())
    assert inspect_build(tmp_path / "one").sources is None
    schema = pa.ipc.open_stream((tmp_path / "one" / manifest.shards[0].name).read_bytes()).schema
    assert "source_ids" not in schema.names


@pytest.fixture(scope="module")
def indexed(tmp_path_factory) -> Path:
    """A directory holding three stores and a mixture's index build of them (`index/`)."""
    root = tmp_path_factory.mktemp("mixture-index")
    mixture_sources(root)
    prepack.build_store(root / "web.parquet", root / "web-store")
    prepack.build_store(root / "code.jsonl", root / "code-store")
    mixture = write_mixture(root)
    mixture.write_text(mixture.read_text().replace("web.parquet", "web-store").replace("code.jsonl", "code-store"))
    prepack.build(mixture, root / "index", max_len=128, index_only=True)
    return root


def test_verify_and_inspect_read_a_mixtures_index_build(indexed):
    assert verify_build(indexed / "index", all_problems=True) == []
    checked = invoke_prepack("verify", indexed / "index")
    assert checked.returncode == 0 and "the counts of 3 sources and the stores' shards and documents checked" in checked.stdout
    manifest = json.loads((indexed / "index" / "manifest.json").read_text())
    shown = inspect_build(indexed / "index").sources
    assert [(s.name, s.tokens, s.documents) for s in shown] == [(s["name"], s["tokens"], s["documents"]) for s in manifest["mixture"]["sources"]]


def test_a_damaged_source_store_is_found(indexed, tmp_path):
    root = shutil.copytree(indexed, tmp_path / "copy")
    shard = root / "math-store" / "documents-00000.arrow"
    data = bytearray(shard.read_bytes())
    data[-200] ^= 1  # a token id: the store manifest's sha256 no longer holds
    shard.write_bytes(bytes(data))
    problems = verify_build(root / "index", all_problems=True)
    assert any(p.file == "../math-store/documents-00000.arrow" and "sha256" in p.message for p in problems), problems


def test_another_store_in_a_sources_place_is_refused(indexed, tmp_path):
    root = shutil.copytree(indexed, tmp_path / "copy")
    shutil.rmtree(root / "code-store")
    shutil.copytree(root / "web-store", root / "code-store")
    problems = verify_build(root / "index")
    assert problems[0].column == "mixture.sources" and "source 'code'" in problems[0].message
    with pytest.raises(FormatError, match="the store changed; build the index again"):
        prepack.PackedDataset(root / "index")


@pytest.mark.parametrize(
    "options",
    [{"overflow": "split"}, {"overflow": "truncate"}, {"overflow": "drop"}, {"overflow": "split", "drop_untrained": True}],
)
def test_every_overflow_policy_gives_a_mixture_verify_accepts(clean, tmp_path, options):
    """Per-source segments and tokens follow the overflow policy (code holds documents longer than 64)."""
    manifest = prepack.build(write_mixture(clean.parent, "small.yaml", tokens=6000), tmp_path / "out", max_len=64, **options)
    assert verify_build(tmp_path / "out", all_problems=True) == []
    code = manifest.mixture.sources[1]
    if options["overflow"] == "split":
        assert code.segments > code.documents  # split pieces counted per source
    else:
        assert code.segments == code.documents
    assert inspect_build(tmp_path / "out").sources[1].segments == code.segments


def _swap(raw: dict, key: str, first: int = 0, second: int = 1) -> None:
    sources = raw["mixture"]["sources"]
    sources[first][key], sources[second][key] = sources[second][key], sources[first][key]


def _rename_inputs(raw: dict) -> None:
    """web's and code's names swapped in `inputs` too, as a careful forger would."""
    rename = {"web": "code", "code": "web"}
    for entry in raw["inputs"]:
        name, rest = entry["path"].split("/", 1)
        entry["path"] = f"{rename.get(name, name)}/{rest}"


def _set(path: str, value):
    def edit(raw: dict) -> None:
        *parents, last = path.split(".")
        target = raw["mixture"]
        for step in parents:
            target = target[int(step)] if step.isdigit() else target[step]
        target[last] = value(target[last]) if callable(value) else value

    return edit


# web: one full epoch and a seeded subset; code: a seeded subset (no full epoch); math: 9 copies and more
FORGED = {
    "packs mix sources": (_set("pack_within_source", True), "mixture.pack_within_source"),
    "names swapped": (lambda raw: _swap(raw, "name"), "mixture.sources[0].name"),
    "names swapped, inputs too": (lambda raw: (_swap(raw, "name"), _rename_inputs(raw)), "mixture.seed"),
    "fingerprints swapped": (lambda raw: _swap(raw, "fingerprint"), "fingerprint"),
    "a fingerprint changed": (_set("sources.2.fingerprint", "0" * 64), "fingerprint"),
    "another seed": (_set("seed", lambda seed: seed + 1), "mixture.seed"),
    "another budget": (_set("tokens", lambda tokens: tokens + 5000), "mixture.sources[0].requested_tokens"),
    "another weight": (_set("sources.0.weight", 0.6), "mixture.sources[0].requested_tokens"),
    "requested tokens": (_set("sources.1.requested_tokens", lambda n: n + 1), "mixture.sources[1].requested_tokens"),
    "requested weight": (_set("sources.1.requested_weight", lambda w: w / 2), "mixture.sources[1].requested_weight"),
    "eligible tokens": (_set("sources.0.eligible_tokens", lambda n: n + 1), "mixture.sources[0].eligible_tokens"),
    "a cap the copies exceed": (_set("sources.2.max_epochs", 2), "mixture.sources[2].max_epochs"),
    "a weight and epochs": (_set("sources.0.epochs", 1.0), "mixture.sources[0]"),
    "no weight and no epochs": (_set("sources.1.weight", None), "mixture.sources[1]"),
}


@pytest.mark.parametrize("forged", FORGED)
def test_every_mixture_claim_is_recomputed(packed, forged):
    edit, column = FORGED[forged]
    edit_json(packed / "manifest.json", edit)
    problems = verify_build(packed, all_problems=True)
    assert column in [p.column for p in problems], problems
    checked = invoke_prepack("verify", packed) if forged == "packs mix sources" else None
    if checked is not None:
        assert checked.returncode == 1 and "mixture.pack_within_source" in checked.stdout + checked.stderr


KINDS = {
    "packed within sources": None,
    "in epochs": "seed: 5\nsources:\n  - {name: web, path: web.parquet}\n  - {name: math, path: math-store, epochs: 2.5}\n",
    "epochs and weights": "tokens: 9000\nseed: 1\nsources:\n  - {name: web, path: web.parquet, weight: 2, max_epochs: 3}\n"
    "  - {name: code, path: code.jsonl, epochs: 0.5}\n  - {name: math, path: math-store, weight: 1}\n",
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_mixture_of_every_kind_verifies(clean, tmp_path, kind):
    """The claims verify recomputes are the build's: every request, selection and packing holds them."""
    if KINDS[kind] is None:
        mixture = write_mixture(clean.parent, "within.yaml", within=True)
    else:
        mixture = clean.parent / f"{kind.replace(' ', '-')}.yaml"
        mixture.write_text(KINDS[kind])
    prepack.build(mixture, tmp_path / "out", max_len=128)
    assert verify_build(tmp_path / "out", all_problems=True) == []


@pytest.mark.parametrize(
    ("source", "field", "change"),
    [(1, "eligible_tokens", 1), (1, "eligible_documents", -1), (2, "eligible_tokens", -1)],
)
def test_an_index_builds_selection_is_recomputed_from_its_stores(indexed, tmp_path, source, field, change):
    """code takes no full epoch: its eligible documents are not all in the packs, only its store knows them."""
    root = shutil.copytree(indexed, tmp_path / "copy")
    edit_json(root / "index" / "manifest.json", _set(f"sources.{source}.{field}", lambda n: n + change))
    problems = verify_build(root / "index", all_problems=True)
    assert f"mixture.sources[{source}].{field}" in [p.column for p in problems], problems


@pytest.mark.parametrize("index_only", [False, True], ids=["full", "index"])
def test_a_trained_count_mixtures_trained_tokens_are_recomputed(indexed, tmp_path, index_only):
    """`trained_tokens` (a mixture counting trained tokens) is each source's trained tokens in the packs:
    from the packs' labels in a full build, from the selection made again from the stores in an index build."""
    root = shutil.copytree(indexed, tmp_path / "copy", ignore=shutil.ignore_patterns("index"))
    mixture = write_mixture(root, "trained.yaml", tokens=9000)
    text = "count: trained\n" + mixture.read_text()
    mixture.write_text(text.replace("web.parquet", "web-store").replace("code.jsonl", "code-store") if index_only else text)
    prepack.build(mixture, root / "out", max_len=128, index_only=index_only)
    assert verify_build(root / "out", all_problems=True) == []
    for source in range(3):
        edit_json(root / "out" / "manifest.json", _set(f"sources.{source}.trained_tokens", lambda n: n + 1))
        problems = verify_build(root / "out", all_problems=True)
        assert [p.column for p in problems] == [f"mixture.sources[{source}].trained_tokens"], problems
        edit_json(root / "out" / "manifest.json", _set(f"sources.{source}.trained_tokens", lambda n: n - 1))
