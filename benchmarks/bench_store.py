"""One document store and three builds from it against three builds of the corpus: time and bytes.

    python benchmarks/bench_store.py --docs 20000

The corpus and tokenizer are `bench_tokenize.py`'s (chitchat conversations repeated to --docs
documents as Parquet text, GPT-2 as a local tokenizer directory; nothing downloaded). In one process,
in this order: `prepack.build_store` (`prepack tokenize`), then for each max-len (2048, 4096, 8192)
`prepack.build` from the store and `prepack.build` from the corpus with the same tokenizer. Each pair
must be byte-identical (checked). Prints a markdown table of wall seconds and bytes written.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_tokenize import NUM_PROC, write_inputs  # noqa: E402

import prepack  # noqa: E402

MAX_LENS = (2048, 4096, 8192)


def _bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir())


def _timed(step, *args, **kwargs) -> float:
    start = time.perf_counter()
    step(*args, **kwargs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=20_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus, tokenizer = write_inputs(root, args.docs)
        rows = []
        seconds = _timed(prepack.build_store, corpus, root / "store", tokenizer=tokenizer, num_proc=NUM_PROC)
        store = prepack.read_store_manifest(root / "store")
        rows.append(("store (`prepack tokenize`)", "", seconds, _bytes(root / "store")))
        totals = {"from store": [seconds, _bytes(root / "store")], "from corpus": [0.0, 0]}
        for max_len in MAX_LENS:
            for kind, source, reading in (
                ("from store", root / "store", {}),
                ("from corpus", corpus, {"tokenizer": tokenizer, "num_proc": NUM_PROC}),
            ):
                out = root / f"{kind.replace(' ', '-')}-{max_len}"
                seconds = _timed(prepack.build, source, out, max_len=max_len, **reading)
                rows.append((f"build {kind}", max_len, seconds, _bytes(out)))
                totals[kind][0] += seconds
                totals[kind][1] += _bytes(out)
            same = {p.name: p.read_bytes() for p in (root / f"from-store-{max_len}").iterdir()} == {
                p.name: p.read_bytes() for p in (root / f"from-corpus-{max_len}").iterdir()
            }
            assert same, f"max-len {max_len}: the build from the store differs from the corpus's"
    print(f"{args.docs:,} documents, {store.tokens:,} tokens; {platform.machine()}, {NUM_PROC} tokenizer threads\n")
    print("| step | max-len | wall s | bytes written |\n|---|---:|---:|---:|")
    for step, max_len, seconds, size in rows:
        print(f"| {step} | {max_len} | {seconds:.2f} | {size:,} |")
    for kind, (seconds, size) in totals.items():
        what = "store + 3 builds" if kind == "from store" else "3 builds"
        print(f"| **{what} {kind}** | | **{seconds:.2f}** | **{size:,}** |")


if __name__ == "__main__":
    main()
