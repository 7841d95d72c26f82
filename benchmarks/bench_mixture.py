"""Mixtures: a mixture of the bundled real corpora built in full, and a synthetic billion-token-scale
mixture planned, each against a named peer in the same run.

    python benchmarks/bench_mixture.py --real --synthetic 2000000

`--real`: the demo's chitchat conversations (examples/chitchat.py --inputs-only: 7,168 conversations,
GPT-2 BPE) tokenized as chat into a store, and the Python standard library's own modules (json,
email, http, urllib, logging, the ones found) tokenized as text into a second store, mixed as 75 %
chat (downsampled) and 25 % code (upsampled, about 1.5 epochs) of a 4M-token budget, max-len 4096,
in full and `--index-only`. Peer: `prepack.build` of the chat store alone, same max-len. Median of 3
runs each, in this process; seconds per million packed tokens, and the mixture's realized weights.

`--synthetic N`: three sources of lognormal lengths as bench_plan.py draws them (median ~350, p99
~4k, truncated to 8192): web N documents, code N/2, math N/20, lengths held as a build holds them
(`compact_lengths`, one untrained flag each); a budget of the web's and code's tokens plus twice the
math's, as weights 0.5 / 0.2 / 0.3 (web and code downsampled, math upsampled about 9 times). One fresh
process selects and plans them (`prepack.building.mixture_build.plan_sources`: selection, parts,
`plan_packs` per part); the peer, another fresh process, runs `plan_packs` on the same number of
documents as one corpus (the mixture's documents' lengths). Each reports its time and peak RSS
(`VmHWM`) and its RSS before planning; bytes a packed document = (peak - before) / packed documents.
Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

MEDIAN, P99, MAX_LEN = 350, 4000, 8192
CODE_PACKAGES = ("json", "email", "http", "urllib", "logging", "concurrent", "importlib", "xml")


def status_kib(field: str) -> int:
    return int(Path("/proc/self/status").read_text().split(f"{field}:")[1].split()[0])


def lognormal(n: int, seed: int) -> np.ndarray:
    sigma = math.log(P99 / MEDIAN) / 2.3263
    raw = np.random.default_rng(seed).lognormal(math.log(MEDIAN), sigma, n)
    return np.minimum(np.clip(raw, 1, 32768).astype(np.int64), MAX_LEN)


def synthetic_child(n: int, lengths_file: Path, peer: bool) -> dict:
    from prepack.building.mixture import MixtureSpec
    from prepack.building.mixture_build import plan_sources
    from prepack.building.plan import compact_lengths, plan_packs

    plan_packs(compact_lengths(np.arange(1, 100)), MAX_LEN)  # compile the kernels before measuring
    if peer:  # the mixture's documents' lengths as one corpus, planned as any build plans
        lengths = np.load(lengths_file)
        before, start = status_kib("VmRSS"), time.perf_counter()
        plan = plan_packs(lengths, MAX_LEN, untrained=np.zeros(len(lengths), bool))
        seconds, documents, totals = time.perf_counter() - start, len(lengths), plan.totals()
        return {"seconds": seconds, "before_kib": before, "peak_kib": status_kib("VmHWM"), "documents": documents,
                "source_documents": documents, "packs": plan.packs, "tokens": totals["tokens"], "over": plan.packs - totals["lower_bound"]}
    sizes = {"web": n, "code": n // 2, "math": n // 20}
    firsts = [
        SimpleNamespace(lengths=compact_lengths(lognormal(count, seed)), untrained=np.zeros(count, bool))
        for seed, count in enumerate(sizes.values())
    ]
    tokens = [int(f.lengths.sum(dtype=np.int64)) for f in firsts]
    spec = MixtureSpec.model_validate({
        "tokens": tokens[0] + tokens[1] + 2 * tokens[2],
        "sources": [{"name": k, "path": k, "weight": w} for k, w in zip(sizes, (0.5, 0.2, 0.3))],
    })
    packing = SimpleNamespace(max_len=MAX_LEN, overflow="split", drop_untrained=False, algorithm="ffd", seed=0)
    before, start = status_kib("VmRSS"), time.perf_counter()
    plan, tallies, _ = plan_sources(spec, firsts, packing)
    seconds, peak, totals = time.perf_counter() - start, status_kib("VmHWM"), plan.totals()
    every = np.concatenate([f.lengths for f in firsts])
    np.save(lengths_file, compact_lengths(np.concatenate([every[rows] for rows in plan.rows])))
    return {"seconds": seconds, "before_kib": before, "peak_kib": peak, "documents": sum(t.documents for t in tallies),
            "source_documents": sum(sizes.values()), "packs": plan.packs, "tokens": totals["tokens"], "over": plan.packs - totals["lower_bound"],
            "weights": [[t.requested, t.realized, t.full_epochs, t.partial_documents] for t in tallies]}


def synthetic(n: int) -> None:
    print(f"\n### Planning a synthetic mixture ({n:,} + {n // 2:,} + {n // 20:,} source documents)\n")
    print("| what | source docs | packed docs | tokens | seconds | RSS before (GiB) | peak (GiB) | B / packed doc | packs over ⌈tokens/max_len⌉ |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as directory:
        lengths_file = Path(directory) / "lengths.npy"
        for peer in (False, True):
            command = [sys.executable, __file__, "--child", str(n), "--lengths", str(lengths_file), *(["--peer"] if peer else [])]
            r = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
            per = (r["peak_kib"] - r["before_kib"]) * 1024 / r["documents"]
            name = "plan_packs, the same documents as one corpus (peer)" if peer else "mixture: select + plan_sources"
            print(f"| {name} | {r['source_documents']:,} | {r['documents']:,} | {r['tokens']:,} | {r['seconds']:.2f} | "
                  f"{r['before_kib'] / 2**20:.3f} | {r['peak_kib'] / 2**20:.3f} | {per:.1f} | {r['over']:,} ({r['over'] / (r['packs'] - r['over']):+.4%}) |")
            if not peer:
                weights = r["weights"]
    print("\n| source | requested tokens | realized | full epochs + documents |")
    print("|---|---:|---:|---|")
    for name, (asked, got, epochs, partial) in zip(("web", "code", "math"), weights):
        print(f"| {name} | {asked:,} | {got:,} ({got - asked:+,}) | {epochs} + {partial:,} |")


def _code_corpus(path: Path) -> int:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for package in CODE_PACKAGES for f in (stdlib / package).rglob("*.py"))
    with path.open("w") as out:
        for file in files:
            out.write(json.dumps({"text": file.read_text(encoding="utf-8", errors="replace")}) + "\n")
    return len(files)


def real() -> None:
    import prepack

    work = Path(tempfile.mkdtemp(prefix="bench-mixture-"))
    script = Path(__file__).resolve().parents[1] / "examples" / "chitchat.py"
    subprocess.run([sys.executable, str(script), "--workdir", str(work / "inputs"), "--inputs-only"], check=True, capture_output=True)
    tokenizer = work / "inputs" / "gpt2"
    prepack.build_store(work / "inputs" / "chitchat.jsonl", work / "chat", tokenizer=tokenizer, chat=True)
    files = _code_corpus(work / "code.jsonl")
    prepack.build_store(work / "code.jsonl", work / "code", tokenizer=tokenizer)
    (work / "mix.yaml").write_text(
        "tokens: 4000000\nsources:\n  - {name: chat, path: chat, weight: 0.75}\n  - {name: code, path: code, weight: 0.25}\n"
    )
    runs = {
        "chat store alone (peer)": (work / "chat", False),
        "mixture": (work / "mix.yaml", False),
        "mixture, --index-only": (work / "mix.yaml", True),
    }
    timings = {name: [] for name in runs}
    for _ in range(3):
        for name, (source, index_only) in runs.items():
            start = time.perf_counter()
            manifest = prepack.build(source, work / "out", max_len=4096, overwrite=True, index_only=index_only)
            timings[name].append((time.perf_counter() - start, manifest))
    print(f"\n### A mixture of the bundled real corpora (chitchat as chat, {files} standard library modules as code)\n")
    print("| build | tokens | packs | fill | median s | s per M tokens | × peer |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    peer = None
    for name in runs:
        seconds = statistics.median(t for t, _ in timings[name])
        manifest = timings[name][0][1]
        t = manifest.totals
        rate = seconds / (t.tokens / 1e6)
        peer = rate if peer is None else peer
        print(f"| {name} | {t.tokens:,} | {t.packs:,} | {t.tokens / (t.packs * 4096):.2%} | {seconds:.2f} | {rate:.3f} | {rate / peer:.2f} |")
        if manifest.mixture is not None:
            mixture = manifest.mixture
    print("\n| source | eligible tokens | requested | realized | requested weight | realized weight | epochs |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for s in mixture.sources:
        print(f"| {s.name} | {s.eligible_tokens:,} | {s.requested_tokens:,} | {s.tokens:,} | {s.requested_weight:.4f} | "
              f"{s.weight_realized:.4f} | {s.full_epochs} + {s.partial_documents:,} documents |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real", action="store_true")
    parser.add_argument("--synthetic", type=int, metavar="N")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(synthetic_child(args.child, args.lengths, args.peer)))
        return
    print(f"load average {os.getloadavg()[0]:.1f}")
    if args.real:
        real()
    if args.synthetic:
        synthetic(args.synthetic)
    print(f"\nload average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
