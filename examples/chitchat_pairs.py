"""Preference pairs from a real conversation corpus, packed whole: nothing downloaded.

The pairs are made from the 7,168 conversations of the `chitchat-dataset` package (as
examples/chitchat.py reads them: consecutive turns alternate user / assistant), deterministically
from --seed: for each conversation of two turns or more, one of its first three assistant turns is
drawn; the prompt is the conversation up to it, `chosen` is that real next turn, and `rejected` is an assistant turn drawn from
another conversation (a reply that does not follow). One {"prompt", "chosen", "rejected"} record of
messages a pair, TRL's conversational preference format, in chitchat-inputs/pairs.jsonl, beside the
GPT-2 tokenizer directory examples/chitchat.py writes. Then

    python examples/chitchat_pairs.py --out pairs-packed --max-len 2048

runs

    prepack build chitchat-inputs/pairs.jsonl --tokenizer chitchat-inputs/gpt2 --chat --pairs \\
        --overflow drop --max-len 2048 --out pairs-packed

(with --overwrite when `pairs-packed` is already a build): each pair's two documents, prompt + chosen
and prompt + rejected, in one pack, labels on the completions. A few chitchat turns run to over a
thousand tokens, so a few pairs do not fit 2,048 tokens: `--overflow drop` leaves them out, counted in
the manifest (`--overflow truncate` cuts completions, and refuses a pair whose prompt alone, twice,
fills --max-len). `--inputs-only` writes the pairs and the
tokenizer and stops.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

from chitchat import CHATML, as_chat, chitchat, gpt2_directory  # examples/chitchat.py, beside this script


def preference_pairs(seed: int = 0) -> list[dict]:
    """One pair per conversation of two turns or more, drawn with `seed` (see the module docstring)."""
    conversations = [turns for turns in chitchat() if len(turns) >= 2]
    rng = random.Random(seed)
    pairs = []
    for number, turns in enumerate(conversations):
        # One of the first three assistant turns (odd positions: the user speaks first), so that prompts stay
        # a few turns long, as in preference corpora.
        at = rng.randrange(1, min(len(turns), 6), 2)
        other = rng.randrange(len(conversations) - 1)
        other += other >= number  # another conversation
        replies = conversations[other][1::2]
        rejected = replies[rng.randrange(len(replies))]
        if rejected == turns[at]:  # the same words elsewhere ("lol"): not a preference
            continue
        pairs.append({
            "prompt": as_chat(turns[:at]),
            "chosen": [{"role": "assistant", "content": turns[at]}],
            "rejected": [{"role": "assistant", "content": rejected}],
        })
    return pairs


def write_inputs(workdir: Path, seed: int = 0) -> tuple[Path, Path]:
    """The pairs (pairs.jsonl) and the tokenizer directory (gpt2/, ChatML template) in `workdir`."""
    tokenizer = gpt2_directory(workdir / "gpt2", CHATML)
    corpus = workdir / "pairs.jsonl"
    corpus.write_text("".join(json.dumps(pair) + "\n" for pair in preference_pairs(seed)))
    return corpus, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="pairs-packed", help="output directory (replaced if it is a build)")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawn turns")
    parser.add_argument("--overflow", default="drop", choices=("drop", "truncate", "error"), help="pairs longer than --max-len")
    parser.add_argument("--workdir", help="where the pairs and tokenizer are written (default: chitchat-inputs/ beside --out)")
    parser.add_argument("--inputs-only", action="store_true", help="write the pairs and tokenizer, build nothing")
    args = parser.parse_args()
    workdir = Path(args.workdir) if args.workdir else Path(args.out).parent / "chitchat-inputs"
    corpus, tokenizer = write_inputs(workdir, args.seed)
    print(f"pairs: {corpus}; tokenizer: {tokenizer}", flush=True)
    if args.inputs_only:
        return
    command = [
        "prepack", "build", str(corpus), "--tokenizer", str(tokenizer), "--chat", "--pairs",
        "--overflow", args.overflow, "--max-len", str(args.max_len), "--out", args.out,
    ]
    if Path(args.out, "manifest.json").exists():
        command.append("--overwrite")
    sys.exit(subprocess.call(command))


if __name__ == "__main__":
    main()
