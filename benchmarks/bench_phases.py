"""Where a build's time goes: its three phases, timed inside one `prepack.build` call.

    python benchmarks/bench_phases.py --docs 250000 --shard-size 64 256

Writes the same Parquet corpus as bench_build.py (`--docs` documents, lognormal lengths, random ids)
and builds it `--repeat` times per shard size (MiB), each in a fresh process after a `--settle` pause,
with timers around the build's phases (private functions of the local engine, `prepack.building.engines.local`,
and `prepack.build`'s `plan_packs`, so this script follows their names): `read` (`_store_documents`:
read, check, fingerprint, scratch store), `plan` (`plan_packs`, including the numba cache load),
`write` (`_write_shards`). Also the process's user and
system CPU seconds for the whole build. Prints a markdown table, one row per run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_build import make_corpus


def child(corpus: str, out: str, shard_size: int) -> None:
    build_module = importlib.import_module("prepack.building.build")  # `prepack.build` the name is the function
    engine_module = importlib.import_module("prepack.building.engines.local")
    seconds = {}

    def timed(phase, function):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[phase] = time.perf_counter() - start

        return run

    for phase, module, name in [
        ("read", engine_module, "_store_documents"),
        ("plan", build_module, "plan_packs"),
        ("write", engine_module, "_write_shards"),
    ]:
        setattr(module, name, timed(phase, getattr(module, name)))
    before, start = os.times(), time.perf_counter()
    build_module.build(corpus, out, max_len=8192, shard_size=shard_size)
    after = os.times()
    seconds["total"] = time.perf_counter() - start
    seconds |= {"user": after.user - before.user, "system": after.system - before.system}
    print(json.dumps(seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=250_000)
    parser.add_argument("--shard-size", type=int, nargs="+", default=[64], help="MiB")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds to wait before each run")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], int(args.child[2]))
    print("| shard MiB | read s | plan s | write s | total s | user s | system s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        corpus, out = Path(tmp) / "corpus.parquet", Path(tmp) / "out"
        make_corpus(corpus, args.docs)
        for _ in range(args.repeat):  # interleaved, so a disturbance hits every size alike
            for mib in args.shard_size:
                time.sleep(args.settle)
                command = [sys.executable, __file__, "--child", str(corpus), str(out), str(mib * 2**20)]
                r = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
                shutil.rmtree(out)
                os.sync()
                cells = [f"{r[k]:.2f}" for k in ("read", "plan", "write", "total", "user", "system")]
                print(f"| {mib} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
