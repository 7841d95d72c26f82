"""`prepack export --to lance`: what `lance.dataset` reads is every pack of the build; a rerun holds the same
rows (not the same bytes: Lance names files by random ids and stamps times), and `verify_export` finds a
changed file of the export."""

from __future__ import annotations

from pathlib import Path

import lance
import numpy as np
import pytest

from prepack.exports import export_build, verify_export
from tests.exports.rows import first_difference

pytestmark = pytest.mark.slow  # every test here exports a build (and the session's builds take seconds)


def _rows(export: Path):
    """The export's rows as lance's own reader gives them, one dict of numpy arrays a pack."""
    table = lance.dataset(str(export / "packs.lance")).to_table()
    columns = {name: table.column(name).to_pylist() for name in table.column_names}
    return [{name: np.asarray(values[row]) for name, values in columns.items()} for row in range(table.num_rows)]


@pytest.mark.parametrize("name", ["chat", "chat-index", "mixture", "mixture-index", "pairs"])
def test_lance_reads_every_pack_of_the_build(builds, tmp_path, name):
    export_build(builds[name], "lance", tmp_path / "export")
    assert first_difference(_rows(tmp_path / "export"), builds[name]) is None
    assert verify_export(tmp_path / "export", builds[name]) == []


def test_tampering_with_one_token_fails_the_comparison_and_the_verify(builds, tmp_path):
    export = tmp_path / "export"
    export_build(builds["chat"], "lance", export)
    dataset = lance.dataset(str(export / "packs.lance"))
    dataset.update({"input_ids": "array_concat(array_slice(input_ids, 1, 2), [7], array_slice(input_ids, 4, 10000))"}, where="_rowid = 3")
    assert first_difference(_rows(export), builds["chat"]) == "pack 3, column input_ids"
    problems = verify_export(export, builds["chat"])
    assert problems and all("not listed in export.json" in p or "the file changed" in p for p in problems)


def test_a_rerun_holds_the_same_rows(builds, tmp_path):
    for name in ("a", "b"):
        export_build(builds["mixture-index"], "lance", tmp_path / name)
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))
