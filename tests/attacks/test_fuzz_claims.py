"""Hypothesis changes one claimed figure of a manifest's `pairs` or `mixture` section: `verify` must find it
(a problem) or refuse the build by name (a `PrepackError`), never report no problems and never raise
anything else. The builds: a preference-pair build (`tests.corpus.preference_pairs`) and a mixture's
index build, whose sources' stores let verify make every source's selection again.

What no file can tell apart is left out by the strategies, each with its reason (schemas/shard-format.md,
"Mixtures"): the mixture file's `path` text, a `max_epochs` the copies stay under, a budget within the
rounding of every source's request, `pack_within_source` false on packs that happen not to mix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import prepack
from prepack.check.verify import verify_build
from prepack.errors import PrepackError
from prepack.formats.shards import Manifest
from tests.corpus import mixture_sources, preference_pairs, write_mixture

CASES = int(os.environ.get("FUZZ_CLAIM_CASES", 120))
_ODD = st.sampled_from([None, -1, 2**63, 1.5, "7", [], {}, True])  # refused by the manifest's schema


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    return preference_pairs(tmp_path_factory.mktemp("fuzz-pairs"))


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> Path:
    """A mixture's index build (`index/`) of three stores; web takes a full epoch and more, code a seeded
    subset, math 8 full epochs and more under max_epochs 12."""
    root = tmp_path_factory.mktemp("fuzz-mixture")
    mixture_sources(root)
    prepack.build_store(root / "web.parquet", root / "web-store")
    prepack.build_store(root / "code.jsonl", root / "code-store")
    path = write_mixture(root)
    path.write_text(path.read_text().replace("web.parquet", "web-store").replace("code.jsonl", "code-store"))
    prepack.build(path, root / "index", max_len=128, index_only=True)
    return root / "index"


def _found_or_refused(build: Path, raw: dict, **source) -> None:
    """Write `raw` as `build`'s manifest, verify, and put the valid manifest back. A change the manifest's
    reader does not see (a value it reads as the old one: "7" for 7) is no change."""
    manifest = build / "manifest.json"
    valid = manifest.read_text()
    try:
        assume(Manifest.model_validate(raw) != Manifest.model_validate_json(valid))
    except ValidationError:
        pass  # refused as it is read: verify reports it
    manifest.write_text(json.dumps(raw))
    try:
        problems = verify_build(build, all_problems=True, **source)
    except PrepackError:
        return
    finally:
        manifest.write_text(valid)
    assert problems, f"no problems with {json.dumps(raw)[:2000]}"


def _changed(old: int, data: st.DataObject, smallest: int = 1) -> int:
    """`old` moved by at least `smallest`, kept a count (>= 0)."""
    down = st.integers(smallest, old).map(lambda by: old - by) if old >= smallest else st.nothing()
    return data.draw(st.integers(smallest, 10**6).map(lambda by: old + by) | down, label="to")


PAIR_FIELDS = ["pairs", "truncated", "dropped", "prompt_tokens", "completion_tokens", "moved"]


@pytest.mark.slow
@settings(max_examples=CASES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_changed_pair_figure_is_found(pairs, data):
    raw = json.loads((pairs / "manifest.json").read_text())
    field = data.draw(st.sampled_from(PAIR_FIELDS), label="field")
    p = raw["pairs"]
    if field == "moved":  # between prompt and completion, their sum (totals.tokens) kept
        by = data.draw(st.integers(1, p["prompt_tokens"]), label="by")
        p["prompt_tokens"] -= by
        p["completion_tokens"] += by
    elif data.draw(st.booleans(), label="an odd value"):
        p[field] = data.draw(_ODD, label="value")
    else:
        p[field] = _changed(p[field], data)
    # A truncated pair fills max_len, as an untruncated one may: which were cut only the corpus says.
    source = {"source": pairs.parent / "pairs.jsonl", "tokenizer": pairs.parent / "gpt2"} if field == "truncated" else {}
    _found_or_refused(pairs, raw, **source)


SOURCE_COUNTS = ["first_row", "rows", "eligible_documents", "eligible_tokens", "requested_tokens", "full_epochs",
                 "partial_documents", "documents", "segments", "tokens"]


def _mixture_change(raw: dict, data: st.DataObject) -> None:
    mixture = raw["mixture"]
    sources = mixture["sources"]
    field = data.draw(st.sampled_from(["tokens", "seed", "pack_within_source", "source"]), label="field")
    if data.draw(st.integers(0, 9), label="an odd value") == 0:
        target = mixture if field != "source" else sources[data.draw(st.integers(0, len(sources) - 1), label="source")]
        key = field if field != "source" else data.draw(st.sampled_from(sorted(target)), label="key")
        assume(key not in ("path", "max_epochs"))  # a text verify does not read; a cap the copies may stay under
        target[key] = data.draw(_ODD, label="value")
        return
    if field == "tokens":
        # A budget moved by at most one token per source may round to the same requests: move it further.
        mixture["tokens"] = _changed(mixture["tokens"], data, smallest=len(sources) + 1)
    elif field == "seed":
        mixture["seed"] = data.draw(st.integers(0, 2**63 - 1).filter(lambda seed: seed != mixture["seed"]), label="seed")
    elif field == "pack_within_source":
        mixture["pack_within_source"] = True  # the build's packs mix sources; false is what it says already
    else:
        number = data.draw(st.integers(0, len(sources) - 1), label="source")
        s = sources[number]
        key = data.draw(st.sampled_from([*SOURCE_COUNTS, "name", "fingerprint", "weight", "epochs", "max_epochs",
                                         "requested_weight", "weight_realized"]), label="key")
        old = s[key]
        if key in SOURCE_COUNTS:
            s[key] = _changed(old, data)
        elif key == "name":  # another source's (two of one name), or a new one
            s[key] = data.draw(st.sampled_from([t["name"] for t in sources]) | st.from_regex(r"\A[a-z][a-z0-9]{0,8}\Z"), label="name")
        elif key == "fingerprint":
            s[key] = data.draw(st.from_regex(r"\A[0-9a-f]{64}\Z"), label="fingerprint")
        elif key in ("weight", "requested_weight", "weight_realized"):
            factor = data.draw(st.floats(1.001, 50) | st.floats(0.02, 0.999), label="factor")
            s[key] = old * factor if key == "weight" else min(old * factor, 1.0)
            assume(abs(s[key] - old) > 1e-6)  # verify compares the realized weights to 1e-9
        elif key == "epochs":
            s[key] = data.draw(st.floats(0.01, 100), label="epochs")  # beside a weight: a source gives one
        else:  # max_epochs: a cap below the copies taken (one above them builds the same packs)
            copies = s["full_epochs"] + (s["partial_documents"] > 0)
            assume(copies > 1)
            s[key] = data.draw(st.integers(1, copies - 1), label="max_epochs")
        assume(s[key] != old)


@pytest.mark.slow
@settings(max_examples=CASES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_changed_mixture_figure_is_found(mixture, data):
    raw = json.loads((mixture / "manifest.json").read_text())
    before = json.dumps(raw["mixture"])
    _mixture_change(raw, data)
    assume(json.dumps(raw["mixture"]) != before)
    _found_or_refused(mixture, raw)
