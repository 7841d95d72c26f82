"""Mixtures (`prepack build MIX.yaml`): the mixture file is checked strictly, each source's selection
is whole documents within one document of its request, and the build's packs hold exactly the
selected documents, copies of one document never in one pack, with per-source counts in the manifest."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import prepack
from prepack.building.mixture import load_mixture, mixture_flags, requested_tokens, select_source
from prepack.errors import InputError
from prepack.training.dataset import PackedDataset
from tests.cli import WIDE, failure, invoke_prepack, run_prepack
from tests.corpus import MIXTURE, edit_json, mixture_sources, read_build, write_mixture

@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    return (root, *mixture_sources(root))


def _mixture(root: Path, name: str, tokens: int = 20000, within: bool = False) -> Path:
    return write_mixture(root, name, tokens, within)


def _packed_documents(packs: list[dict], manifest: dict) -> list[tuple[int, int, int, int, list[int], list[int] | None]]:
    """(pack, source, row in its source, piece, tokens, labels) of every document of every pack."""
    firsts = [s["first_row"] for s in manifest["mixture"]["sources"]]
    out = []
    for number, pack in enumerate(packs):
        cu = pack["cu_seqlens"]
        for d, (row, piece, source) in enumerate(zip(pack["source_rows"], pack["source_pieces"], pack["source_ids"])):
            labels = pack["labels"][cu[d] : cu[d + 1]] if "labels" in pack else None
            out.append((number, source, row - firsts[source], piece, pack["input_ids"][cu[d] : cu[d + 1]], labels))
    return out


def test_a_mixture_packs_exactly_the_selected_documents(sources, tmp_path):
    root, docs, labels = sources
    max_len = 128
    manifest = prepack.build(_mixture(root, "mix.yaml"), tmp_path / "out", max_len=max_len)
    on_disk, packs = read_build(tmp_path / "out")
    names = [s["name"] for s in on_disk["mixture"]["sources"]]
    assert names == ["web", "code", "math"]
    copies = Counter()
    for pack, source, row, piece, tokens, pack_labels in _packed_documents(packs, on_disk):
        name = names[source]
        document = docs[name][row]
        assert tokens == document[piece * max_len : (piece + 1) * max_len]
        # web has labels; the others are trained on every token (their labels are their ids)
        want = labels[name][row] if labels[name] is not None else document
        assert pack_labels == want[piece * max_len : (piece + 1) * max_len]
        copies[(source, row, piece)] += 1
    by_name = {s.name: s for s in manifest.mixture.sources}
    # web upsampled (1 epoch and a subset), code downsampled, math upsampled 8 times and more
    assert by_name["web"].full_epochs == 1 and by_name["web"].partial_documents > 0
    assert by_name["code"].full_epochs == 0 and by_name["code"].documents < len(docs["code"]) - 1
    assert by_name["math"].full_epochs >= 8
    for number, name in enumerate(names):
        s = by_name[name]
        lengths = [len(d) for d in docs[name]]
        assert abs(s.tokens - s.requested_tokens) <= max(lengths)  # within one document of the request
        taken = {key: count for key, count in copies.items() if key[0] == number and key[2] == 0}
        assert sum(taken.values()) == s.documents
        assert set(taken.values()) <= {s.full_epochs, s.full_epochs + 1}
        assert sum(1 for c in taken.values() if c == s.full_epochs + 1) == s.partial_documents
        assert s.tokens == sum(len(t) for _, src, _, _, t, _ in _packed_documents(packs, on_disk) if src == number)
    assert (1, 5, 0) not in copies  # the empty document
    assert sum(s.tokens for s in manifest.mixture.sources) == manifest.totals.tokens
    assert [f["path"].split("/")[0] for f in on_disk["inputs"]] == ["web", "code", "math"]


def test_copies_of_a_document_never_share_a_pack(sources, tmp_path):
    root, _, _ = sources
    prepack.build(_mixture(root, "mix.yaml"), tmp_path / "out", max_len=2048)
    manifest, packs = read_build(tmp_path / "out")
    math = manifest["mixture"]["sources"][2]
    assert math["full_epochs"] >= 8  # 30 short documents, many copies each, 2048-token packs: room for all
    neighbours = {}
    for pack in packs:
        keys = list(zip(pack["source_rows"], pack["source_pieces"]))
        assert len(keys) == len(set(keys)), "a pack holds two copies of a document"
        for row in pack["source_rows"]:
            neighbours.setdefault(row, []).append(frozenset(pack["source_rows"]) - {row})
    # a copy meets other documents than the copy before it
    repeated = [sets for sets in neighbours.values() if len(sets) > 1]
    assert repeated and all(len(set(sets)) == len(sets) for sets in repeated)


def test_pack_within_source(sources, tmp_path):
    root, _, _ = sources
    prepack.build(_mixture(root, "within.yaml", within=True), tmp_path / "out", max_len=512)
    _, packs = read_build(tmp_path / "out")
    assert all(len(set(pack["source_ids"])) == 1 for pack in packs)
    assert {pack["source_ids"][0] for pack in packs} == {0, 1, 2}


def test_a_mixture_build_is_reproducible(sources, tmp_path):
    root, _, _ = sources
    mixture = _mixture(root, "mix.yaml")

    def digest(out: Path) -> dict[str, str]:
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.iterdir())}

    prepack.build(mixture, tmp_path / "a", max_len=256)
    prepack.build(mixture, tmp_path / "b", max_len=256)
    assert digest(tmp_path / "a") == digest(tmp_path / "b")


@given(
    lengths=st.lists(st.integers(0, 500), min_size=1, max_size=60),
    share=st.floats(0.0, 6.0, allow_nan=False),
    seed=st.integers(0, 2**32),
)
@settings(max_examples=300, deadline=None)
def test_selection_is_within_one_document_of_the_request(lengths, share, seed):
    tokens = np.array(lengths, dtype=np.int64)
    available = int(tokens.sum())
    assume(available > 0)
    requested = round(share * available)
    selection = select_source("s", tokens, requested, seed)
    realized = selection.epochs * available + int(tokens[selection.partial].sum())
    assert selection.realized == realized
    # the rest is a subset of whole eligible documents, none twice; the error at most one document
    assert len(set(selection.partial.tolist())) == len(selection.partial)
    assert (tokens[selection.partial] > 0).all()
    assert abs(realized - requested) <= int(tokens.max())
    assert selection.epochs == requested // available
    again = select_source("s", tokens, requested, seed)
    assert np.array_equal(again.partial, selection.partial)


def test_requested_tokens_share_the_budget_left_by_epochs():
    spec = load_mixture_text("tokens: 1000\nsources:\n  - {name: a, path: a, weight: 3}\n  - {name: b, path: b, weight: 1}\n  - {name: c, path: c, epochs: 2}\n")
    assert requested_tokens(spec, [100, 100, 100]) == [600, 200, 200]
    with pytest.raises(InputError, match="nothing is left"):
        requested_tokens(spec, [100, 100, 600])


def load_mixture_text(text: str, name: str = "mix.yaml", directory: Path | None = None):
    import tempfile

    directory = Path(directory or tempfile.mkdtemp())
    (directory / name).write_text(text)
    return load_mixture(directory / name)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("sources:\n  - {name: a, path: a, weight: 1}\n", "a weight is a share of a token budget"),
        ("tokens: 10\nsources:\n  - {name: a, path: a, weight: '2'}\n", "sources[0].weight"),
        ("tokens: 10\nsources:\n  - {name: a, path: a, weight: 1, colour: red}\n", "sources[0].colour"),
        ("tokens: 10\nsources:\n  - {name: a, path: a, weight: 1}\n  - {name: a, path: b, weight: 1}\n", "'a' appear twice"),
        ("tokens: 10\nsources:\n  - {name: a, path: a, weight: 1, epochs: 2}\n", "not both"),
        ("sources:\n  - {name: a, path: a, max_epochs: 2}\n", "max_epochs caps a weight"),
        ("tokens: 10\ntokens: 20\nsources: []\n", "key 'tokens' appears twice"),
        ("tokens: -5\nsources:\n  - {name: a, path: a, weight: 1}\n", "tokens"),
        ("sources:\n  - {name: ../x, path: a}\n", "sources[0].name"),
        ("- a\n- b\n", "not list"),
    ],
)
def test_a_bad_mixture_file_is_refused_by_file_and_field(tmp_path, text, field):
    with pytest.raises(InputError) as refused:
        load_mixture_text(text, directory=tmp_path)
    message = str(refused.value)
    assert str(tmp_path / "mix.yaml") in message and field in message


def test_the_cli_builds_a_mixture_and_refuses_a_bad_one(sources, tmp_path):
    root, _, _ = sources
    result = run_prepack("build", _mixture(root, "mix.yaml"), "--max-len", "256", "--out", tmp_path / "out", env=WIDE)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["mixture"]["seed"] == 3
    for source in manifest["mixture"]["sources"]:  # the summary names every source's tokens and documents
        assert f"source {source['name']}" in result.stdout and f"{source['tokens']:,} tokens" in result.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("tokens: 100\nsources:\n  - {name: a, path: a.parquet, weigth: 1}\n")
    message = failure(run_prepack("build", bad, "--max-len", "256", "--out", tmp_path / "out2", env=WIDE))
    assert f"{bad}: invalid mixture: sources[0].weigth" in message
    assert not (tmp_path / "out2").exists()


def test_max_epochs_refuses_more_copies(sources, tmp_path):
    root, _, _ = sources
    mixture = root / "capped.yaml"
    mixture.write_text(MIXTURE.format(tokens=20000, within="false").replace("max_epochs: 12", "max_epochs: 2"))
    with pytest.raises(InputError, match="source 'math'.*its max_epochs is 2"):
        prepack.build(mixture, tmp_path / "out", max_len=256)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def stores(sources) -> Path:
    """The mixture with every source a document store, beside which index builds lie."""
    root, _, _ = sources
    prepack.build_store(root / "web.parquet", root / "web-store")
    prepack.build_store(root / "code.jsonl", root / "code-store")
    path = root / "stores.yaml"
    path.write_text(MIXTURE.format(tokens=20000, within="false").replace("web.parquet", "web-store").replace("code.jsonl", "code-store"))
    return path


def test_an_index_build_of_a_mixture_serves_the_full_builds_rows(stores):
    """The issue's target: full and index-only builds of one mixture, rows equal, counts equal."""
    root = stores.parent
    full = prepack.build(stores, root / "full", max_len=128, overwrite=True)
    index = prepack.build(stores, root / "index", max_len=128, index_only=True, overwrite=True)
    assert [s.model_dump(exclude={"store"}) for s in index.mixture.sources] == [s.model_dump(exclude={"store"}) for s in full.mixture.sources]
    assert [s.store for s in index.mixture.sources] == ["../web-store", "../code-store", "../math-store"]
    assert index.totals == full.totals
    whole, indexed = PackedDataset(root / "full"), PackedDataset(root / "index")
    assert len(whole) == len(indexed)
    for number in range(len(whole)):
        a, b = whole[number], indexed[number]
        assert sorted(a) == sorted(b) == ["cu_seqlens", "input_ids", "labels", "segment_ids", "source_ids"]
        for key in a:
            assert np.array_equal(a[key], b[key]), (number, key)
    index_bytes = sum(f.stat().st_size for f in (root / "index").glob("shard-*.arrow"))
    assert index_bytes < sum(f.stat().st_size for f in (root / "full").glob("shard-*.arrow")) / 3  # no token copied


def test_an_index_build_of_a_mixture_needs_stores_beside_it(sources, stores, tmp_path):
    root, _, _ = sources
    with pytest.raises(InputError, match="source 'web' \\(web.parquet\\) is not one"):
        prepack.build(_mixture(root, "mix.yaml"), root / "index-of-corpora", max_len=128, index_only=True)
    with pytest.raises(InputError, match="an index build must lie beside its store"):
        prepack.build(stores, tmp_path / "elsewhere", max_len=128, index_only=True)
    assert not (root / "index-of-corpora").exists() and not (tmp_path / "elsewhere").exists()


def test_a_mixtures_index_build_is_read_where_it_was_built(stores):
    root = stores.parent
    if not (root / "index").exists():
        prepack.build(stores, root / "index", max_len=128, index_only=True)
    with pytest.raises(InputError, match="a mixture's index build: it reads the stores its manifest names"):
        PackedDataset(root / "index", store=root / "math-store")
    with pytest.raises(InputError, match="open_hf_dataset does not gather"):
        prepack.open_hf_dataset(root / "index")


def test_overflow_error_names_the_source_file_row_and_column(sources, tmp_path):
    root, docs, _ = sources
    row = next(i for i, d in enumerate(docs["code"]) if len(d) > 128)
    with pytest.raises(InputError) as refused:
        prepack.build(_mixture(root, "mix.yaml"), tmp_path / "out", max_len=128, overflow="error")
    assert f"source 'code': {root / 'code.jsonl'}, row {row}, column 'input_ids': {len(docs['code'][row])} tokens" in str(refused.value)
    assert not (tmp_path / "out").exists()


# The flags of `MIXTURE` (tests/corpus.py), and of a mixture in epochs packed within sources.
MIXTURE_FLAGS = [
    "--source", "web=web.parquet:0.5", "--source", "code=code.jsonl:weight=0.2",
    "--source", "math=math-store:0.3,max_epochs=12", "--tokens", "20000", "--mix-seed", "3",
]
EPOCHS = "seed: 5\npack_within_source: true\nsources:\n  - {name: web, path: web.parquet}\n  - {name: math, path: math-store, epochs: 2.5}\n"
EPOCHS_FLAGS = ["--source", "web=web.parquet", "--source", "math=math-store:epochs=2.5", "--mix-seed", "5", "--pack-within-source"]


@pytest.mark.parametrize(("text", "flags"), [(None, MIXTURE_FLAGS), (EPOCHS, EPOCHS_FLAGS)], ids=["weights", "epochs"])
def test_the_flags_build_the_files_bytes(sources, tmp_path, text, flags):
    """`prepack build --source …` and `prepack build MIX.yaml` with the same mixture: byte-identical
    builds (the sources' relative paths read from the working directory, as the file's from its own)."""
    root, _, _ = sources
    mixture = _mixture(root, "mix.yaml") if text is None else root / "epochs.yaml"
    if text is not None:
        mixture.write_text(text)
    from_file = invoke_prepack("build", mixture.name, "--max-len", "256", "--out", tmp_path / "a", cwd=root, env=WIDE)
    from_flags = invoke_prepack("build", *flags, "--max-len", "256", "--out", tmp_path / "b", cwd=root, env=WIDE)
    assert from_file.returncode == 0 and from_flags.returncode == 0, (from_file.stderr, from_flags.stderr)
    files = sorted(path.name for path in (tmp_path / "a").iterdir())
    assert files == sorted(path.name for path in (tmp_path / "b").iterdir()) and "manifest.json" in files
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert from_flags.stdout.replace(str(tmp_path / "b"), "OUT") == from_file.stdout.replace(str(tmp_path / "a"), "OUT")


def test_the_flags_build_the_files_index_build(stores):
    """--index-only over stores: the flags' index build is the file's, byte for byte."""
    root = stores.parent
    flags = [flag.replace("web.parquet", "web-store").replace("code.jsonl", "code-store") for flag in MIXTURE_FLAGS]
    for name, args in (("index-of-file", [stores.name]), ("index-of-flags", flags)):
        built = invoke_prepack("build", *args, "--index-only", "--max-len", "128", "--out", name, "--overwrite", cwd=root, env=WIDE)
        assert built.returncode == 0, built.stderr
    names = sorted(path.name for path in (root / "index-of-file").iterdir())
    assert names == sorted(path.name for path in (root / "index-of-flags").iterdir()) and "manifest.json" in names
    for name in names:
        assert (root / "index-of-file" / name).read_bytes() == (root / "index-of-flags" / name).read_bytes(), name
    assert json.loads((root / "index-of-flags" / "manifest.json").read_text())["mixture"]["sources"][0]["store"] == "../web-store"


def test_the_flags_parse_into_the_files_spec(tmp_path):
    flags = [
        "web=corpora/web/:0.6,max_epochs=2", "code=stores/code:weight=0.3", "math=s3://bucket/math/:epochs=2",
        "chat=s3://bucket/chat/", "tiny=gs://b/t:1.5",
    ]
    text = (
        "tokens: 50000000\nseed: 7\npack_within_source: true\nsources:\n"
        "  - {name: web, path: corpora/web/, weight: 0.6, max_epochs: 2}\n  - {name: code, path: stores/code, weight: 0.3}\n"
        "  - {name: math, path: 's3://bucket/math/', epochs: 2}\n  - {name: chat, path: 's3://bucket/chat/'}\n"
        "  - {name: tiny, path: 'gs://b/t', weight: 1.5}\n"
    )
    mixture = mixture_flags(None, flags, "50000000", "7", True)
    assert mixture.spec == load_mixture_text(text, directory=tmp_path)
    assert mixture.base == str(Path.cwd())
    assert mixture_flags(None, ["a=x"], None, None, False).spec == load_mixture_text("sources:\n  - {name: a, path: x}\n", directory=tmp_path)
    assert mixture_flags("corpus.parquet", [], None, None, False) is None
    counted = mixture_flags(None, ["a=x:1"], "10", None, False, "trained").spec
    assert counted == load_mixture_text("tokens: 10\ncount: trained\nsources:\n  - {name: a, path: x, weight: 1}\n", directory=tmp_path)
    with pytest.raises(InputError, match="--mix-count: Input should be 'tokens' or 'trained'"):
        mixture_flags(None, ["a=x:1"], "10", None, False, "labels")


@pytest.mark.parametrize(
    ("corpus", "flags", "tokens", "seed", "message"),
    [
        (None, ["web"], "10", None, "--source 'web': give NAME=PATH[:AMOUNT]"),
        (None, ["web=w:weigth=1"], "10", None, "--source 'web=w:weigth=1': weigth: Extra inputs are not permitted"),
        (None, ["web=w:0.5"], None, None, "--source: Value error, a weight is a share of a token budget: give 'tokens' (--tokens)"),
        (None, ["web=w:-1"], "10", None, "--source 'web=w:-1': weight: Input should be greater than 0"),
        (None, ["web=w:true"], "10", None, "--source 'web=w:true': weight: Input should be a valid number"),
        (None, ["web=w:1", "web=v:2"], "10", None, "'web' appear twice"),
        (None, ["web=w:1,epochs=2"], "10", None, "--source 'web=w:1,epochs=2': Value error, give a weight or epochs, not both"),
        (None, ["web=w:max_epochs=2.5,weight=1"], "10", None, "--source 'web=w:max_epochs=2.5,weight=1': max_epochs: Input should be a valid integer"),
        (None, ["web=w:epochs=2,max_epochs=3"], None, None, "max_epochs caps a weight"),
        (None, ["web=w:1,"], "10", None, "--source 'web=w:1,': an empty amount in '1,'"),
        (None, ["web=w:1,weight=2"], "10", None, "--source 'web=w:1,weight=2': 'weight' is given twice"),
        (None, ["web=w:name=x"], "10", None, "--source 'web=w:name=x': 'name' is given twice"),
        (None, ["../x=w"], None, None, "--source '../x=w': name: String should match pattern"),
        (None, ["web=w:1"], "-5", None, "--tokens: Input should be greater than or equal to 1"),
        (None, ["web=w:1"], "lots", None, "--tokens: Input should be 'all'"),
        (None, ["web=w:1"], "10", "-1", "--mix-seed: Input should be greater than or equal to 0"),
        (None, ["web=w:1"], "10", "x", "--mix-seed: Input should be a valid integer"),
        ("c.parquet", ["web=w:1"], None, None, "c.parquet is a corpus, and the mixture flags (--source) build a mixture of --source flags"),
        ("mix.yaml", [], "10", None, "mix.yaml is a mixture file, and the mixture flags (--tokens) give one too"),
        (None, [], "10", "1", "the mixture flags (--tokens, --mix-seed) need a CORPUS (or a mixture file), or a mixture's sources"),
        (None, [], None, None, "prepack build needs a CORPUS (or a mixture file), or a mixture's sources, each as --source NAME=PATH[:AMOUNT]"),
    ],
)
def test_bad_mixture_flags_are_refused_naming_the_flag(corpus, flags, tokens, seed, message):
    with pytest.raises(InputError) as refused:
        mixture_flags(corpus, flags, tokens, seed, False)
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--source", "web=web.parquet:0.5"], "invalid mixture flags: --source: Value error, a weight is a share of a token budget"),
        (["mix.yaml", "--pack-within-source"], "mix.yaml is a mixture file, and the mixture flags (--pack-within-source) give one too"),
        (["web.parquet", "--source", "web=web.parquet"], "web.parquet is a corpus, and the mixture flags (--source) build a mixture of --source flags"),
        (["--source", "web=web.parquet:weight=0", "--tokens", "100"], "--source 'web=web.parquet:weight=0': weight: Input should be greater than 0"),
    ],
)
def test_the_cli_refuses_bad_mixture_flags(sources, tmp_path, args, message):
    root, _, _ = sources
    _mixture(root, "mix.yaml")
    assert message in failure(invoke_prepack("build", *args, "--max-len", "256", "--out", tmp_path / "out", cwd=root, env=WIDE))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('{"tokens": 10, "tokens": 20, "sources": [{"name": "a", "path": "a", "weight": 1}]}', "'tokens'"),
        ('{"tokens": 10, "sources": [{"name": "a", "path": "a", "weight": 1, "weight": 3}]}', "'weight'"),
    ],
)
def test_a_json_mixture_file_refuses_a_key_given_twice_as_yaml_does(tmp_path, text, key):
    """One rule for both formats: json.loads alone would keep the last of the two values."""
    with pytest.raises(InputError) as refused:
        load_mixture_text(text, "mix.json", tmp_path)
    message = str(refused.value)
    assert str(tmp_path / "mix.json") in message and f"key {key} appears twice" in message


@pytest.mark.parametrize(
    ("text", "named"),
    [
        # their sum is past the largest float (math.fsum raised OverflowError)
        ("tokens: 1\nsources:\n  - {name: a, path: a, weight: 1.0e+308}\n  - {name: b, path: b, weight: 1.0e+308}\n",
         "the weights of sources 'a', 'b' sum past the largest float"),
        # one weight times the budget is past it
        ("tokens: 1000000\nsources:\n  - {name: a, path: a, weight: 1.0e+305}\n  - {name: b, path: b, weight: 1}\n",
         "source 'a': weight 1e+305 times the budget"),
    ],
)
def test_weights_that_overflow_are_refused_by_file_and_source(tmp_path, text, named):
    with pytest.raises(InputError) as refused:
        load_mixture_text(text, directory=tmp_path)
    message = str(refused.value)
    assert str(tmp_path / "mix.yaml") in message and named in message


def test_large_weights_in_proportion_share_the_budget_as_small_ones_do():
    big = load_mixture_text("tokens: 1000\nsources:\n  - {name: a, path: a, weight: 3.0e+300}\n  - {name: b, path: b, weight: 1.0e+300}\n")
    assert requested_tokens(big, [100, 100]) == [750, 250]


@pytest.mark.parametrize(
    ("amount", "limit"),
    [
        ("weight: 1", "at most 10,000 copies of a document"),  # with --tokens 10**12: no max_epochs
        ("weight: 1, max_epochs: 3", "its max_epochs is 3"),
        ("epochs: 100000", "sources[0].epochs"),  # refused with the file, before a source is read
    ],
)
def test_a_request_beyond_the_copies_allowed_is_refused_before_planning(sources, tmp_path, amount, limit):
    root, docs, _ = sources
    mixture = root / f"huge-{amount.replace(' ', '').replace(':', '').replace(',', '')}.yaml"
    mixture.write_text(f"tokens: 1000000000000\nsources:\n  - {{name: math, path: math-store, {amount}}}\n")
    with pytest.raises(InputError) as refused:
        prepack.build(mixture, tmp_path / "out", max_len=128)
    message = str(refused.value)
    assert limit in message
    if "epochs:" not in amount:  # the request, what the source gives, the limit
        available = sum(len(d) for d in docs["math"])
        assert "source 'math'" in message and "1,000,000,000,000 tokens" in message and f"its {available:,} packable tokens" in message
    assert not (tmp_path / "out").exists()


def test_a_request_beyond_memory_is_refused_with_its_numbers():
    from prepack.building.mixture import check_memory

    spec = load_mixture_text("tokens: 100000000\nsources:\n  - {name: a, path: a, weight: 1}\n")
    selection = select_source("a", np.full(1000, 10, np.int64), 100_000_000, 0)  # 10,000 copies of 1,000 documents
    check_memory(spec, [selection], memory=10**9)  # 10**7 documents fit in 1 GB
    with pytest.raises(InputError) as refused:
        check_memory(spec, [selection], memory=10**7)
    message = str(refused.value)
    assert "source 'a'" in message and "10,000,000 documents" in message and "10,000,000 bytes of memory" in message
    assert "100,000,000 tokens" in message and "its 10,000 packable tokens" in message


def _segment_values(lengths: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Each document's pieces under --overflow split: (offsets per document, tokens per piece)."""
    pieces = -(-lengths // max_len)
    offsets = np.concatenate([[0], np.cumsum(pieces)])
    values = np.concatenate([[min(max_len, n - j * max_len) for j in range(p)] for n, p in zip(lengths, pieces)] or [np.zeros(0, np.int64)])
    return offsets, np.asarray(values, dtype=np.int64)


@given(
    lengths=st.lists(st.integers(0, 3000), min_size=1, max_size=30),
    max_len=st.integers(16, 512),
    share=st.floats(0.0, 3.0, allow_nan=False),
    seed=st.integers(0, 2**32),
    trained=st.booleans(),
)
@settings(max_examples=100, deadline=None)
def test_split_selection_is_within_one_piece_of_the_request(lengths, max_len, share, seed, trained):
    """With --overflow split, the document at the subset's boundary is cut at a piece boundary: the realized
    amount (tokens, or trained tokens per piece) is within one piece of the request, not one document."""
    tokens = np.array(lengths, dtype=np.int64)
    offsets, values = _segment_values(tokens, max_len)
    if trained:  # a piece's trained tokens: fewer than its tokens (its first token is never trained), some none
        values = np.maximum(values - 1 - (np.arange(len(values)) % 3 == 0) * values // 2, 0)
    per_document = np.bincount(np.repeat(np.arange(len(tokens)), np.diff(offsets)), weights=values, minlength=len(tokens)).astype(np.int64)
    available = int(per_document.sum())
    assume(available > 0)
    requested = round(share * available)
    selection = select_source("s", per_document, requested, seed, pieces=lambda row: values[offsets[row] : offsets[row + 1]])
    counted = selection.epochs * available + int(per_document[selection.partial].sum())
    if selection.cut_pieces:
        row = selection.cut_row
        assert row in selection.partial.tolist() and 0 < selection.cut_pieces < offsets[row + 1] - offsets[row]
        counted -= int(values[offsets[row] + selection.cut_pieces : offsets[row + 1]].sum())
    assert selection.realized == counted
    assert abs(selection.realized - requested) <= int(values.max())  # within one piece
    assert selection.epochs == requested // available


@pytest.fixture(scope="module")
def plays(tmp_path_factory) -> Path:
    """Short summaries beside long plays (labels: a prompt of -100, then trained), plays also as a store."""
    from tests.corpus import corpus_table, write_corpus

    root = tmp_path_factory.mktemp("plays")
    rng = np.random.default_rng(11)
    for name, count, low, high in (("summaries", 300, 20, 120), ("plays", 12, 1500, 4000)):
        docs = [rng.integers(1, 500, size=rng.integers(low, high)).tolist() for _ in range(count)]
        labels = [[-100] * (len(d) // 3) + d[len(d) // 3 :] for d in docs]
        write_corpus(root / f"{name}.parquet", corpus_table(docs, labels))
    prepack.build_store(root / "summaries.parquet", root / "summaries-store")
    prepack.build_store(root / "plays.parquet", root / "plays-store")
    return root


def _plays_mixture(root: Path, count: str, stores: bool = False) -> Path:
    suffix = "-store" if stores else ".parquet"
    path = root / f"plays-{count}{'-stores' if stores else ''}.yaml"
    path.write_text(
        f"tokens: 40000\nseed: 5\ncount: {count}\nsources:\n"
        f"  - {{name: summaries, path: summaries{suffix}, weight: 0.8}}\n"
        f"  - {{name: plays, path: plays{suffix}, weight: 0.2}}\n"
    )
    return path


def _trained_in_packs(packs: list[dict], manifest: dict) -> list[int]:
    """Each source's trained tokens in the packs: labels other than -100, a segment's first token never."""
    trained = [0] * len(manifest["mixture"]["sources"])
    for pack in packs:
        cu = pack["cu_seqlens"]
        for d, source in enumerate(pack["source_ids"]):
            trained[source] += sum(1 for label in pack["labels"][cu[d] + 1 : cu[d + 1]] if label != -100)
    return trained


@pytest.mark.slow
@pytest.mark.parametrize("count", ["tokens", "trained"])
def test_a_split_mixture_of_plays_realizes_its_shares_within_one_piece(plays, tmp_path, count):
    """The issue's case: a 0.2 share of plays (one play ~3 % of the budget) lands within one piece of
    its request, counted in tokens or in trained tokens; `verify` passes on the full and the index build."""
    from prepack.check.verify import verify_build

    max_len = 256
    manifest = prepack.build(_plays_mixture(plays, count), tmp_path / "full", max_len=max_len)
    on_disk, packs = read_build(tmp_path / "full")
    realized = _trained_in_packs(packs, on_disk) if count == "trained" else [s.tokens for s in manifest.mixture.sources]
    for source, got in zip(manifest.mixture.sources, realized):
        assert abs(got - source.requested_tokens) <= max_len, (source.name, got, source.requested_tokens)
        assert (source.trained_tokens == got) if count == "trained" else source.trained_tokens is None
    plays_source = manifest.mixture.sources[1]
    assert plays_source.full_epochs == 0 and plays_source.partial_documents < 12  # a subset of plays, one of them cut
    assert verify_build(tmp_path / "full", all_problems=True) == []
    if count == "tokens":
        assert "count" not in on_disk["mixture"] and "trained_tokens" not in on_disk["mixture"]["sources"][0]
    index = prepack.build(_plays_mixture(plays, count, stores=True), plays / f"index-{count}", max_len=max_len, index_only=True)
    assert [s.tokens for s in index.mixture.sources] == [s.tokens for s in manifest.mixture.sources]
    assert verify_build(plays / f"index-{count}", all_problems=True) == []
    # verify makes the selection again from the stores (trained tokens from their labels): another seed differs
    edit_json(plays / f"index-{count}" / "manifest.json", lambda raw: raw["mixture"].update(seed=6))
    assert "mixture.seed" in {problem.column for problem in verify_build(plays / f"index-{count}", all_problems=True)}


def test_the_scratch_holds_only_the_selected_documents(plays, tmp_path, monkeypatch):
    """Sources are read for their lengths first, and only their selected documents' tokens are copied to
    scratch: its bytes follow the selection (a sixth of a corpus, a few plays of a store), not the sources."""
    from prepack.building.engines.local import LocalEngine

    scratch = {}
    write_packs = LocalEngine.write_packs

    def measured(self, plan, first, shard_size, progress):
        scratch.update({path.parent.name: path.stat().st_size for path in first.tokens.paths})
        return write_packs(self, plan, first, shard_size, progress)

    monkeypatch.setattr(LocalEngine, "write_packs", measured)
    mixture = tmp_path / "small.yaml"
    mixture.write_text(
        "tokens: 4000\nsources:\n  - {name: summaries, path: " + str(plays / "summaries.parquet") + ", weight: 0.9}\n"
        "  - {name: plays, path: " + str(plays / "plays-store") + ", weight: 0.1}\n"
    )
    manifest = prepack.build(mixture, tmp_path / "out", max_len=256)
    on_disk, packs = read_build(tmp_path / "out")
    for number, source in enumerate(manifest.mixture.sources):
        assert source.full_epochs == 0
        rows = {row for pack in packs for row, s in zip(pack["source_rows"], pack["source_ids"]) if s == number}
        whole_tokens = source.eligible_tokens
        selected_tokens = sum(len(d) for d in _documents_of(plays, source.name, [row - source.first_row for row in rows]))
        assert scratch[f"source-{number:05d}"] == 4 * selected_tokens < 4 * whole_tokens / 3


def _documents_of(root: Path, name: str, rows: list[int]) -> list[list[int]]:
    import pyarrow.parquet as pq

    column = pq.read_table(root / f"{name}.parquet", columns=["input_ids"]).column("input_ids").to_pylist()
    return [column[row] for row in rows]


@pytest.mark.parametrize(
    "changed",
    [[[1, 2, 3], [4, 5, 6, 8]], [[1, 2, 3], [4, 5, 6, 7], [9, 9]]],
    ids=["the same lengths, another token", "a row more"],
)
def test_a_corpus_that_changes_between_the_two_reads_is_refused(plays, tmp_path, monkeypatch, changed):
    from prepack.building.engines.local import LocalEngine
    from tests.corpus import corpus_table, write_corpus

    corpus = tmp_path / "changing.parquet"
    write_corpus(corpus, corpus_table([[1, 2, 3], [4, 5, 6, 7]]))
    read_lengths = LocalEngine.read_lengths

    def then_changed(self, documents, reading, progress, observe=None):
        read = read_lengths(self, documents, reading, progress, observe)
        write_corpus(corpus, corpus_table(changed))
        return read

    monkeypatch.setattr(LocalEngine, "read_lengths", then_changed)
    mixture = tmp_path / "changing.yaml"
    mixture.write_text(f"tokens: 3\nsources:\n  - {{name: a, path: {corpus}, weight: 1.0}}\n")  # one of the two rows
    with pytest.raises(InputError, match="read a second time, the corpus gives other documents"):
        prepack.build(mixture, tmp_path / "out", max_len=16)
    assert not (tmp_path / "out").exists()


def _two_stores(root: Path, shift: int, extra: int = 0) -> None:
    """A store `root`/store-SHIFT-EXTRA of six documents of 40 tokens in three shards, its tokens `shift` above
    the first's, `extra` tokens more in its last document."""
    from tests.corpus import corpus_table, write_corpus

    docs = [[shift + 7 * d + t for t in range(40 + (extra if d == 5 else 0))] for d in range(6)]
    write_corpus(root / f"corpus-{shift}-{extra}.parquet", corpus_table(docs))
    prepack.build_store(root / f"corpus-{shift}-{extra}.parquet", root / f"store-{shift}-{extra}", shard_size=400)


@pytest.mark.parametrize("extra", [0, 5], ids=["the same lengths", "other lengths"])
def test_a_store_replaced_between_the_two_reads_is_refused(tmp_path, monkeypatch, extra):
    """The second pass reads the store the first one opened (its manifest, its shards' sha256): a store
    put in its place meanwhile is refused by its changed shard, never packed under the first's fingerprint."""
    from prepack.building.engines.local import LocalEngine
    from prepack.errors import FormatError

    _two_stores(tmp_path, 0)
    _two_stores(tmp_path, 1, extra)
    read_lengths = LocalEngine.read_lengths

    def then_replaced(self, documents, reading, progress, observe=None):
        read = read_lengths(self, documents, reading, progress, observe)
        (tmp_path / "store-0-0").rename(tmp_path / "was")
        (tmp_path / f"store-1-{extra}").rename(tmp_path / "store-0-0")
        return read

    monkeypatch.setattr(LocalEngine, "read_lengths", then_replaced)
    mixture = tmp_path / "replaced.yaml"
    mixture.write_text(f"sources:\n  - {{name: a, path: {tmp_path / 'store-0-0'}}}\n")
    with pytest.raises(FormatError, match="store-0-0/documents-00000.arrow: its sha256 is not the store manifest's: the shard changed"):
        prepack.build(mixture, tmp_path / "out", max_len=64)
    assert not (tmp_path / "out").exists()


def test_a_changed_store_shard_that_holds_no_selected_document_is_refused(tmp_path):
    """A full build's selection depends on every document's length: every store shard is checked (its
    sha256) before the selection, not only those holding a selected document."""
    from prepack.errors import FormatError

    _two_stores(tmp_path, 0)
    store = tmp_path / "store-0-0"
    shards = json.loads((store / "store.json").read_text())["shards"]
    assert len(shards) == 3 and [s["documents"] for s in shards] == [2, 2, 2]
    mixture = tmp_path / "few.yaml"
    mixture.write_text(f"tokens: 40\nseed: 1\nsources:\n  - {{name: a, path: {store}, weight: 1.0}}\n")
    prepack.build(mixture, tmp_path / "before", max_len=64)
    _, packs = read_build(tmp_path / "before")
    selected = {row for pack in packs for row in pack["source_rows"]}
    assert len(selected) == 1
    unselected = next(s["name"] for number, s in enumerate(shards) if not {2 * number, 2 * number + 1} & selected)
    data = bytearray((store / unselected).read_bytes())
    data[-9] ^= 1  # a byte near the end: a token of its last document, not its offsets
    (store / unselected).write_bytes(bytes(data))
    with pytest.raises(FormatError, match=f"{unselected}: its sha256 is not the store manifest's: the shard changed"):
        prepack.build(mixture, tmp_path / "after", max_len=64)
    assert not (tmp_path / "after").exists()


def test_a_trained_count_index_build_and_its_verify_read_each_store_shard_once(tmp_path, monkeypatch):
    """Counting trained tokens needs every label: the index build's first pass and `verify` each read a
    store shard's columns once (hashed once), and take its lengths from them."""
    from prepack.check.verify import verify_build
    from prepack.sources.store import Store

    _two_stores(tmp_path, 0)
    _two_stores(tmp_path, 1)
    mixture = tmp_path / "trained.yaml"
    mixture.write_text(
        f"tokens: 200\ncount: trained\nsources:\n  - {{name: a, path: {tmp_path / 'store-0-0'}, weight: 1}}\n"
        f"  - {{name: b, path: {tmp_path / 'store-1-0'}, weight: 1}}\n"
    )
    reads = Counter()
    batch = Store._batch

    def counted(self, shard, whole):
        reads[(self.root.name, shard.name)] += 1
        return batch(self, shard, whole)

    monkeypatch.setattr(Store, "_batch", counted)
    prepack.build(mixture, tmp_path / "index", max_len=64, index_only=True)
    assert len(reads) == 6 and set(reads.values()) == {1}
    reads.clear()
    assert verify_build(tmp_path / "index", all_problems=True) == []
    assert len(reads) == 6 and set(reads.values()) == {1}


@pytest.mark.parametrize("count", ["tokens", "trained"])
def test_a_trained_token_budget_never_selects_a_document_without_a_trained_token(tmp_path, count):
    """With `count: trained` a document whose packed pieces hold no trained token (all -100, or its one
    trained token a segment's first) adds nothing to the budget: it is not eligible and never packed,
    where counting tokens packs it."""
    from tests.corpus import corpus_table, write_corpus

    docs = [[1, 2, 3, 4], [5, 6, 7], [8, 9], [10, 11, 12]]
    labels = [[1, 2, 3, 4], [-100, -100, -100], [8, -100], [-100, 11, 12]]
    write_corpus(tmp_path / "sft.parquet", corpus_table(docs, labels))
    mixture = tmp_path / "sft.yaml"
    mixture.write_text(f"count: {count}\nsources:\n  - {{name: sft, path: {tmp_path / 'sft.parquet'}}}\n")
    manifest = prepack.build(mixture, tmp_path / "out", max_len=8)
    _, packs = read_build(tmp_path / "out")
    packed = sorted(row for pack in packs for row in pack["source_rows"])
    source = manifest.mixture.sources[0]
    if count == "trained":
        assert packed == [0, 3] and source.eligible_documents == 2 and source.trained_tokens == source.eligible_tokens == 5
    else:
        assert packed == [0, 1, 2, 3] and source.eligible_documents == 4 and source.eligible_tokens == 12


@pytest.mark.slow
def test_inspect_shows_a_trained_count_mixtures_trained_tokens(plays, tmp_path):
    from prepack.check.report import inspect_build

    manifest = prepack.build(_plays_mixture(plays, "trained"), tmp_path / "out", max_len=256)
    report = inspect_build(tmp_path / "out")
    assert [s.trained_tokens for s in report.sources] == [s.trained_tokens for s in manifest.mixture.sources]
    shown = invoke_prepack("inspect", tmp_path / "out", env=WIDE)
    assert shown.returncode == 0, shown.stderr
    assert "requested trained tokens" in shown.stdout and f"{manifest.mixture.sources[1].trained_tokens:,}" in shown.stdout


@given(
    documents=st.lists(st.lists(st.integers(1, 2000), min_size=1, max_size=12), min_size=2, max_size=3),
    weights=st.lists(st.floats(0.1, 1.0), min_size=3, max_size=3),
    budget_share=st.floats(0.05, 2.5),
    max_len=st.integers(32, 300),
    trained=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=25, deadline=None)
def test_a_split_mixtures_plan_realizes_every_share_within_one_piece(documents, weights, budget_share, max_len, trained, seed):
    """Selection, parts and plans together (`plan_sources`): every source's packed tokens (or trained tokens,
    counted per piece from its labels) are within one piece of its request, and the plan packs exactly them."""
    from prepack.building.engines.base import FirstPass
    from prepack.building.mixture import MixtureSpec, piece_counts, trained_segments
    from prepack.building.mixture_build import plan_sources
    from prepack.building.build import Packing

    rng = np.random.default_rng(seed)
    firsts, counts = [], []
    for lengths in documents:
        lengths = np.array(lengths, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        labels = np.where(rng.random(int(offsets[-1])) < 0.4, -100, 1).astype(np.int32)
        firsts.append(FirstPass(lengths.astype(np.int32), np.zeros(len(lengths), bool), [len(lengths)], "0" * 64, True, None, None))
        counts.append(piece_counts([trained_segments(offsets, labels, max_len, "split")]))
    amounts = [int(c.trained.sum()) if trained else int(f.lengths.sum()) for c, f in zip(counts, firsts)]
    assume(all(amounts))
    spec = MixtureSpec.model_validate({
        "tokens": max(1, round(budget_share * sum(amounts))),
        "count": "trained" if trained else "tokens",
        "sources": [{"name": f"s{i}", "path": "x", "weight": weights[i]} for i in range(len(documents))],
    })
    try:
        plan, tallies, _ = plan_sources(spec, firsts, Packing(max_len=max_len), counts if trained else None)
    except InputError as exc:  # a budget so small that every source is asked for no token
        assume("selects no document" not in str(exc))
        raise
    packed = plan.slice(0, plan.packs)
    for number, (tally, c) in enumerate(zip(tallies, counts)):
        assert abs(tally.realized - tally.requested) <= (int(c.trained.max()) if trained else max_len)
        mine = packed.source_ids == number
        assert int(packed.lengths[mine].sum()) == tally.tokens
        if trained:  # the pieces packed, counted again
            per_piece = {(row, piece): value for row in range(len(c.offsets) - 1) for piece, value in enumerate(c.of(row))}
            first_row = int(plan.first_rows[number])
            assert sum(per_piece[(int(r) - first_row, int(p))] for r, p in zip(packed.rows[mine], packed.pieces[mine])) == tally.realized
