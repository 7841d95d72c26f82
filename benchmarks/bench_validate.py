"""What validating every input batch in full costs, against reading the batch at all.

    python benchmarks/bench_validate.py

`prepack.sources.corpus.record_batches` calls `RecordBatch.validate(full=True)` on every batch before a value is
used (offsets monotonic and inside their buffers, UTF-8 of strings). This times that call on batches
of the size a build reads (8,192 rows; lognormal "SFT" lengths as in bench_build.py, random ids)
against the same batch read from an Arrow IPC file and from Parquet. Prints a markdown table of
microseconds per batch, the fastest of `--repeat` rounds.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROWS = 8_192


def fastest(call, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.86, 1.0, ROWS).astype(np.int64), 1, 32_768)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 128_000, offsets[-1])))
    texts = pa.array(["word " * int(n) for n in lengths[:ROWS]])
    batches = {
        "token ids, list<int64>": pa.record_batch([ids], names=["input_ids"]),
        "text, string": pa.record_batch([texts], names=["text"]),
    }
    print(f"| batch of {ROWS:,} rows | MB | validate(full=True) µs | read from Arrow µs | read from Parquet µs |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, batch in batches.items():
            arrow, parquet = Path(tmp) / "b.arrow", Path(tmp) / "b.parquet"
            with pa.ipc.new_stream(arrow, batch.schema) as writer:
                writer.write_batch(batch)
            pq.write_table(pa.Table.from_batches([batch]), parquet)

            def read_arrow():
                with pa.memory_map(str(arrow)) as source:
                    pa.ipc.open_stream(source).read_all()

            validate = fastest(lambda: batch.validate(full=True), args.repeat)
            from_arrow = fastest(read_arrow, args.repeat)
            from_parquet = fastest(lambda: pq.read_table(parquet), args.repeat)
            size = batch.nbytes / 1e6
            print(f"| {name} | {size:,.1f} | {validate:,.0f} | {from_arrow:,.0f} | {from_parquet:,.0f} |")


if __name__ == "__main__":
    main()
