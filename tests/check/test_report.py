"""`prepack inspect`: every number against an independent computation from the corpus we generated
(and the packs as plain pyarrow reads them); the rendering, the plot and the CLI."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from prepack import build
from prepack.errors import FormatError, InputError, MissingExtraError
from prepack.check.report import InspectReport, _figure, inspect_build, plot, render
from tests.cli import failure, invoke_prepack, run_prepack
from tests.corpus import corpus_table, edit_json, read_build, write_corpus

MAX_LEN = 64


def corpus_lengths() -> list[int]:
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 60, size=400).tolist()
    lengths[::37] = [0] * len(lengths[::37])  # empty documents
    lengths[5::53] = [150, 64, 65, 200, 129, 300, 70, 64][: len(lengths[5::53])]  # long and exactly max_len
    return lengths


def expected_segments(lengths: list[int], overflow: str) -> list[int]:
    """Segment lengths in corpus (row, piece) order, as the overflow policy defines them."""
    segments = []
    for n in lengths:
        if n == 0 or (n > MAX_LEN and overflow == "drop"):
            continue
        if n > MAX_LEN and overflow == "truncate":
            n = MAX_LEN
        segments += [min(MAX_LEN, n - start) for start in range(0, n, MAX_LEN)]
    return segments


def nearest_rank(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


def random_batch_cost(segments: list[int], batch_size: int, seed: int) -> int:
    order = np.random.default_rng(seed).permutation(len(segments))
    shuffled = [segments[i] for i in order]
    batches = [shuffled[i : i + batch_size] for i in range(0, len(shuffled), batch_size)]
    return sum(len(batch) * max(batch) for batch in batches)


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("report")
    rng = np.random.default_rng(8)
    documents = [rng.integers(0, 1000, size=n).tolist() for n in corpus_lengths()]
    corpus = write_corpus(tmp / "c.parquet", corpus_table(documents))
    outs = {}
    for overflow in ("split", "truncate", "drop"):
        outs[overflow] = tmp / overflow
        build(corpus, outs[overflow], max_len=MAX_LEN, overflow=overflow, shard_size=3000, seed=1)
    return outs


def check_distribution(dist, values: list[float]) -> None:
    assert dist.count == len(values)
    assert dist.min == min(values) and dist.max == max(values)
    assert dist.mean == pytest.approx(sum(values) / len(values))
    for p in (50, 90, 99):
        assert getattr(dist, f"p{p}") == pytest.approx(nearest_rank(values, p))
    assert sum(dist.counts) == len(values)
    assert len(dist.edges) == len(dist.counts) + 1
    assert dist.edges[0] <= min(values) and max(values) <= dist.edges[-1]
    # Every bin holds exactly the values in [edges[i], edges[i+1]) (the last bin closed).
    edges = dist.edges
    for i, count in enumerate(dist.counts):
        last = i == len(dist.counts) - 1
        assert count == sum(edges[i] <= v < edges[i + 1] or (last and v == edges[-1]) for v in values)


@pytest.mark.parametrize("overflow", ["split", "truncate", "drop"])
def test_numbers_match_an_independent_computation(builds, overflow):
    lengths = corpus_lengths()
    segments = expected_segments(lengths, overflow)
    _, packs = read_build(builds[overflow])
    report = inspect_build(builds[overflow], batch_size=8, seed=3)

    tokens = sum(segments)
    long = [n for n in lengths if n > MAX_LEN]
    assert report.documents == len(lengths)
    assert report.input_tokens == sum(lengths)
    assert report.segments == len(segments)
    assert report.tokens == tokens
    assert report.packs == len(packs)
    assert report.max_len == MAX_LEN
    assert report.fill == pytest.approx(tokens / (len(packs) * MAX_LEN))
    assert report.padding_tokens == len(packs) * MAX_LEN - tokens
    assert report.lower_bound == -(-tokens // MAX_LEN)
    assert report.over_lower_bound == len(packs) - report.lower_bound
    assert report.over_lower_bound_percent == pytest.approx(
        100 * report.over_lower_bound / report.lower_bound
    )
    assert report.empty == lengths.count(0)
    assert report.split == (len(long) if overflow == "split" else 0)
    assert report.split_pieces == (sum(-(-n // MAX_LEN) for n in long) if overflow == "split" else 0)
    assert report.truncated == (len(long) if overflow == "truncate" else 0)
    assert report.truncated_tokens == (sum(n - MAX_LEN for n in long) if overflow == "truncate" else 0)
    assert report.dropped == (len(long) if overflow == "drop" else 0)
    assert report.dropped_tokens == (sum(long) if overflow == "drop" else 0)

    check_distribution(report.documents_per_pack, [len(p["source_rows"]) for p in packs])
    check_distribution(report.document_length, segments)
    check_distribution(report.pack_fill, [len(p["input_ids"]) / MAX_LEN for p in packs])

    packed = len(packs) * MAX_LEN
    assert report.cost.packed.tokens == packed and report.cost.packed.ratio == 1
    assert report.cost.pad_to_max_len.tokens == len(segments) * MAX_LEN
    assert report.cost.pad_to_max_len.padding_tokens == len(segments) * MAX_LEN - tokens
    assert report.cost.pad_to_max_len.ratio == pytest.approx(len(segments) * MAX_LEN / packed)
    random = random_batch_cost(segments, 8, seed=3)
    assert report.cost.pad_to_longest_in_batch.tokens == random
    assert report.cost.pad_to_longest_in_batch.ratio == pytest.approx(random / packed)

    assert report.shards == len(report.per_shard) > 3
    assert sum(s.packs for s in report.per_shard) == len(packs)
    assert sum(s.tokens for s in report.per_shard) == tokens
    assert sum(s.documents for s in report.per_shard) == len(segments)


def test_batch_baseline_limits_need_no_shuffle(builds):
    """Batches of 1 pad nothing; one batch of everything pads every document to the longest."""
    segments = expected_segments(corpus_lengths(), "split")
    one = inspect_build(builds["split"], batch_size=1)
    assert one.cost.pad_to_longest_in_batch.tokens == sum(segments)
    assert one.cost.pad_to_longest_in_batch.padding_tokens == 0
    everything = inspect_build(builds["split"], batch_size=10**6, seed=5)
    assert everything.cost.pad_to_longest_in_batch.tokens == len(segments) * max(segments)


def test_json_dump_is_the_report(builds):
    report = inspect_build(builds["split"])
    dumped = json.loads(json.dumps(report.model_dump(mode="json")))
    assert InspectReport.model_validate(dumped) == report
    for key in ("documents", "tokens", "packs", "max_len", "fill", "padding_tokens", "lower_bound"):
        assert key in dumped


def test_render_shows_the_numbers(builds):
    report = inspect_build(builds["split"])
    console = Console(record=True, width=130)
    console.print(render(report, shards=True))
    text = console.export_text()
    for number in (report.documents, report.tokens, report.packs, report.padding_tokens, report.lower_bound):
        assert f"{number:,}" in text
    assert f"{report.fill:.3%}" in text
    assert f"{report.cost.pad_to_max_len.ratio:.2f}" in text
    assert "shard-00000.arrow" in text
    assert "segments in the packs" in text  # the footnote on what "document length" means
    console = Console(record=True, width=130)
    console.print(render(report))
    assert "shard-00000.arrow" not in console.export_text()


def test_each_histogram_runs_from_its_lower_label_to_its_upper_label(builds):
    """The bins of every terminal histogram sit between its two labels, the last bin (which holds the
    maximum) right before the upper one, however many bins it has (pack fill: 20, lengths: 32)."""
    report = inspect_build(builds["split"])
    console = Console(record=True, width=130)
    console.print(render(report))
    lines = console.export_text().splitlines()
    lines = lines[[line.strip() for line in lines].index("histograms") :]
    start = next(line.index("bins") for line in lines if "bins" in line)  # where the bins' column begins
    dists = {
        "documents per pack": (report.documents_per_pack, True),
        "document length": (report.document_length, True),
        "pack fill": (report.pack_fill, False),
    }
    assert {len(d.counts) for d, _ in dists.values()} >= {20, 32}
    for name, (dist, integer) in dists.items():
        low, high = dist.edges[0], dist.edges[-1] - integer
        labels = (f"{low:,.0f}", f"{high:,.0f}") if integer else (f"{low:.1%}", f"{high:.1%}")
        (line,) = [line for line in lines if line.lstrip().startswith(name)]
        assert line[:start].rstrip().endswith(f" {labels[0]}") and line.rstrip().endswith(f" {labels[1]}"), line
        bars = line.rstrip()[start : -len(labels[1]) - 1]
        repeat = len(bars) // len(dist.counts)
        assert repeat >= 1 and len(bars) == repeat * len(dist.counts), (line, dist.counts)
        for count, chunk in zip(dist.counts, (bars[i : i + repeat] for i in range(0, len(bars), repeat))):
            assert len(set(chunk)) == 1 and (chunk[0] != " ") == (count > 0), (line, dist.counts)


@pytest.mark.slow
def test_plot_panel_titles_stay_whole_inside_the_figure(builds):
    """Long-context numbers (six-digit lengths) in every panel title: each title is drawn within its
    panel's width and inside the figure, nothing cut off at the edge."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    report = inspect_build(builds["split"])
    long = {"p50": 12_345.0, "p90": 65_536.0, "p99": 131_072.0, "max": 131_072.0}
    report = report.model_copy(update={
        "document_length": report.document_length.model_copy(update=long),
        "documents_per_pack": report.documents_per_pack.model_copy(update={k: v / 10 for k, v in long.items()}),
    })
    figure = _figure(report)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer, page = canvas.get_renderer(), figure.bbox
    titles = [ax.title for ax in figure.axes]
    assert any(t.get_text().endswith("p99 131,072, max 131,072") for t in titles)
    for ax, title in zip(figure.axes, titles):
        box, panel = title.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and box.y1 <= page.y1, title.get_text()
        assert box.width <= panel.width, title.get_text()


@pytest.mark.slow
def test_plot_writes_a_png_with_content(builds, tmp_path):
    from matplotlib.image import imread

    path = plot(inspect_build(builds["split"]), tmp_path / "report.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 20_000
    pixels = imread(path)
    assert pixels.shape[0] > 400 and pixels.shape[1] > 600
    assert (pixels[..., :3] < 0.5).mean() > 0.01  # bars and text, not a blank canvas


def test_plot_without_matplotlib_names_the_extra(builds, tmp_path, monkeypatch):
    report = inspect_build(builds["split"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'prepack-llm\[plot\]'"):
        plot(report, tmp_path / "report.png")
    assert not (tmp_path / "report.png").exists()


@pytest.mark.parametrize("name", ["report.xyz", "report"])
def test_plot_to_an_unknown_format_is_refused_before_drawing(builds, tmp_path, name):
    with pytest.raises(InputError, match=r"cannot draw a plot as .*\.png"):
        plot(inspect_build(builds["split"]), tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def test_a_manifest_that_disagrees_with_the_shards_is_refused(builds, tmp_path):
    out = shutil.copytree(builds["split"], tmp_path / "copy")
    edit_json(out / "manifest.json", lambda raw: raw["totals"].update(tokens=raw["totals"]["tokens"] + 1))
    with pytest.raises(FormatError, match="prepack verify"):
        inspect_build(out)


@pytest.mark.slow
def test_import_does_not_pull_torch_or_matplotlib():
    code = "import sys, prepack.check.report; print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


@pytest.mark.slow
def test_cli_json_text_and_plot(builds, tmp_path):
    result = run_prepack("inspect", str(builds["split"]), "--json", "--batch-size", "4", "--seed", "2")
    assert result.returncode == 0, result.stderr
    numbers = json.loads(result.stdout)
    assert numbers == inspect_build(builds["split"], batch_size=4, seed=2).model_dump(mode="json")

    result = invoke_prepack("inspect", str(builds["split"]), "--shards", "--plot", str(tmp_path / "r.png"))
    assert result.returncode == 0, result.stderr
    assert "shard-00000.arrow" in result.stdout and f"{numbers['packs']:,}" in result.stdout
    assert (tmp_path / "r.png").stat().st_size > 20_000
    assert result.stdout.endswith(f"plot written to {tmp_path / 'r.png'}\n")

    result = invoke_prepack("inspect", str(builds["split"]), "--json", "--plot", str(tmp_path / "j.png"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["packs"] == numbers["packs"]  # stdout stays JSON
    assert f"plot written to {tmp_path / 'j.png'}" in result.stderr and (tmp_path / "j.png").is_file()


@pytest.mark.slow
def test_cli_errors_exit_2(builds, tmp_path):
    result = invoke_prepack("inspect", str(tmp_path / "nothing"))
    assert result.returncode == 2 and result.stdout == ""
    assert "not a finished prepack build" in " ".join(result.stderr.split())
    result = invoke_prepack("inspect", str(builds["split"]), "--plot", str(tmp_path / "report.xyz"))
    assert "cannot draw a plot as .xyz" in failure(result)


def test_batch_size_below_1_is_refused(builds):
    with pytest.raises(InputError, match="batch_size"):
        inspect_build(builds["split"], batch_size=0)


def test_a_pair_build_reports_its_pairs_and_trls_padding(tmp_path):
    """The pairs' counts from the manifest, and TRL's padding computed by TRL's own collator on the same
    pairs in the same batches (corpus order, shuffled with the seed)."""
    import torch  # noqa: F401  (TRL's collator returns tensors)
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from prepack import PackedDataset
    from tests.demo_inputs import CHATML, chitchat_pairs, gpt2_directory

    corpus = tmp_path / "pairs.jsonl"
    corpus.write_text("".join(json.dumps(pair) + "\n" for pair in chitchat_pairs()[:30]))
    build(corpus, tmp_path / "out", max_len=384, tokenizer=gpt2_directory(tmp_path / "gpt2", CHATML), chat=True,
          pairs=True, overflow="drop", num_proc=1)
    report = inspect_build(tmp_path / "out", batch_size=4, seed=3)
    manifest = report.pairs
    assert manifest.read == 30 and manifest.pairs == 30 - manifest.dropped and manifest.dropped > 0
    documents = {}
    for pack in PackedDataset(tmp_path / "out"):
        cu = pack["cu_seqlens"]
        for j in range(len(cu) - 1):
            documents[len(documents)] = (pack["input_ids"][cu[j] : cu[j + 1]], pack["labels"][cu[j] : cu[j + 1]])
    # Pairs in corpus order: the packs hold them shuffled, source_rows says where each came from.
    rows = np.concatenate(list(_shard_rows(tmp_path / "out")))
    by_row = {int(row): documents[i] for i, row in enumerate(rows)}
    examples = []
    for row in sorted(by_row)[0::2]:
        (chosen, labels), (rejected, _) = by_row[row], by_row[row + 1]
        prompt = int(np.flatnonzero(labels != -100)[0])
        examples.append({"prompt_ids": chosen[:prompt].tolist(), "chosen_ids": chosen[prompt:].tolist(),
                         "rejected_ids": rejected[prompt:].tolist()})
    assert manifest.prompt_tokens == 2 * sum(len(e["prompt_ids"]) for e in examples)
    assert manifest.completion_tokens == sum(len(e["chosen_ids"]) + len(e["rejected_ids"]) for e in examples)
    shuffled = [examples[i] for i in np.random.default_rng(3).permutation(len(examples))]
    collate = DataCollatorForPreference(pad_token_id=0)
    padded = sum(collate(shuffled[i : i + 4])["input_ids"].numel() for i in range(0, len(shuffled), 4))
    assert manifest.trl_padded.tokens == padded
    assert manifest.trl_padded.padding_tokens == padded - report.tokens
    assert manifest.shared_prompt_saves == manifest.prompt_tokens // 2
    text = _rendered(report)
    assert "TRL DPOTrainer, random batches of 4 pairs" in text and f"{padded:,}" in text


def _shard_rows(build_dir: Path):
    from prepack.formats.shards import open_shard, read_manifest

    manifest = read_manifest(build_dir)
    for info in manifest.shards:
        batch = open_shard(build_dir / info.name, True, manifest.options.max_len, pairs=2)
        offsets = np.asarray(batch.column("source_rows").offsets)
        values = np.asarray(batch.column("source_rows").values)
        yield from (values[offsets[i] : offsets[i + 1]] for i in range(batch.num_rows))


def _rendered(report: InspectReport) -> str:
    console = Console(record=True, width=200)
    console.print(render(report))
    return console.export_text()
