"""Compiled training on packed batches: prepack's fixed-shape batches against its default batches and HF's
`DataCollatorWithFlattening`, the same documents in the same steps; and what a cap on documents per pack costs.

    python benchmarks/bench_compile.py                       # both parts
    python benchmarks/bench_compile.py --caps-only           # the cost of K alone (no model)
    python examples/chitchat.py --out packed --max-len 2048  # then, to price K on the demo's build too:
    python benchmarks/bench_compile.py --caps-only --build packed

Training: chitchat's lines as text documents (GPT-2 tokenized; ids folded into --vocab), built into packs of
--max-len with `--max-docs-per-pack --cap` (every collator gets the same packs, so the same documents in every
step). A random Llama (--hidden, --layers, sdpa, float32, CPU) trains --steps steps of --batch packs with
prepack's token-weighted loss (prepack's batches with `enable_packing`; HF's on the model as transformers gives
it, which isolates them on sdpa from their position ids), eagerly and under `torch.compile` (inductor) with
`dynamic=False` (what CUDA graphs and `mode="reduce-overhead"` need) and with the default `dynamic=None`:
- prepack fixed: `PackedCollator(max_len, max_docs_per_pack=cap)`: [B, L] rows, B·(cap + 1) + 1 offsets;
- prepack default: `PackedCollator(max_len)`: [B, L] rows, offsets as many as the batch's segments;
- HF flattening: `DataCollatorWithFlattening` on the same documents: one row of the batch's tokens.
For each it prints the graphs dynamo compiled (`counters["stats"]["unique_graphs"]`: more than one is a
recompile; dynamo stops compiling a function after 8 and runs it uncompiled), real tokens a second over every
step (compilation included) and over the second half (compiled steps), and the ratio to eager.

The cost of K: packs and fill of a first-fit-decreasing plan capped at K documents, against the uncapped plan,
on a long-tail synthetic corpus (--documents lognormal lengths, median --median, sigma --sigma, up to
--caps-max-len, which is also its max-len) and, with
--build, on an existing build (`prepack inspect --caps`, the same numbers). Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch._dynamo.utils import counters
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

from prepack import PackedCollator, PackedDataset, build, enable_packing
from prepack.building.plan import plan_packs
from prepack.check.report import inspect_build
from prepack.training.loss import loss_weights, weighted_loss
from tests.demo_inputs import chitchat, gpt2_directory



def packs_of_lines(directory: Path, max_len: int, cap: int, packs: int, vocab: int) -> list[dict]:
    """The first `packs` packs of chitchat's lines built with --max-docs-per-pack `cap`."""
    lines = [line for conversation in chitchat() for line in conversation][: 40 * packs]
    corpus = directory / "lines.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    build(corpus, directory / "packed", max_len=max_len, tokenizer=gpt2_directory(directory / "gpt2"), max_docs_per_pack=cap)
    dataset = PackedDataset(directory / "packed")
    if len(dataset) < packs:
        raise SystemExit(f"only {len(dataset)} packs; lower --steps or --batch")
    return [{"input_ids": np.asarray(dataset[i]["input_ids"]) % vocab, "cu_seqlens": np.asarray(dataset[i]["cu_seqlens"])} for i in range(packs)]


def flattening_batches(packs: list[dict], batch: int) -> list[dict]:
    """HF's `DataCollatorWithFlattening` on the documents of each step's packs."""
    collate = DataCollatorWithFlattening(return_tensors="pt")
    out = []
    for start in range(0, len(packs), batch):
        documents = []
        for pack in packs[start : start + batch]:
            cu = pack["cu_seqlens"]
            documents += [{"input_ids": pack["input_ids"][a:b].tolist()} for a, b in zip(cu[:-1], cu[1:])]
        out.append(dict(collate(documents)) | {"use_cache": False})
    return out


def model(vocab: int, hidden: int, layers: int, max_len: int, packing: bool) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128 or 1,
                         max_position_embeddings=max_len, attn_implementation="sdpa")
    torch.manual_seed(0)
    net = LlamaForCausalLM(config).train()
    return enable_packing(net) if packing else net


def train(batches: list[dict], net: LlamaForCausalLM, compile_options: dict | None) -> tuple[int, list[float]]:
    """(graphs compiled, seconds of every step) for `batches` on `net`, compiled with `compile_options` unless None."""
    torch._dynamo.reset()
    counters.clear()
    forward = net if compile_options is None else torch.compile(net, **compile_options)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    seconds = []
    for batch in batches:
        start = time.perf_counter()
        weights = loss_weights(batch, "token")
        loss = weighted_loss(forward(**batch).logits, batch, weights, weights.sum())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    return counters["stats"]["unique_graphs"], seconds


def training_table(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as directory:
        packs = packs_of_lines(Path(directory), args.max_len, args.cap, args.steps * args.batch, args.vocab)
    real = [sum(len(p["input_ids"]) for p in packs[i : i + args.batch]) for i in range(0, len(packs), args.batch)]
    documents = [len(p["cu_seqlens"]) - 1 for p in packs]
    collators = {
        "prepack fixed": [PackedCollator(args.max_len, max_docs_per_pack=args.cap)(packs[i : i + args.batch]) for i in range(0, len(packs), args.batch)],
        "prepack default": [PackedCollator(args.max_len)(packs[i : i + args.batch]) for i in range(0, len(packs), args.batch)],
        "HF flattening": flattening_batches(packs, args.batch),
    }
    modes = {"eager": None, "compiled, dynamic=False": {"dynamic": False}, "compiled, dynamic=None": {"dynamic": None}}
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"Llama {args.layers} layers x {args.hidden}, vocab {args.vocab}, sdpa, float32; {args.steps} steps of "
          f"{args.batch} packs of {args.max_len} (documents a pack {min(documents)} to {max(documents)}, cap {args.cap})\n")
    print("| batches | mode | graphs | real tokens/s, all steps | second half | x eager (second half) |")
    print("|---|---|---:|---:|---:|---:|")
    half = args.steps // 2
    for name, batches in collators.items():
        eager_rate = None
        for mode, options in modes.items():
            net = model(args.vocab, args.hidden, args.layers, args.max_len, packing=name.startswith("prepack"))
            graphs, seconds = train(batches, net, options)
            overall = sum(real) / sum(seconds)
            steady = sum(real[half:]) / sum(seconds[half:])
            eager_rate = eager_rate or steady
            print(f"| {name} | {mode} | {graphs if options is not None else '-'} | {overall:,.0f} | {steady:,.0f} | {steady / eager_rate:.2f} |", flush=True)


def cap_table(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(args.median), args.sigma, args.documents), 1, args.max_len).astype(np.int64)
    plain = plan_packs(lengths, args.max_len)
    per_pack = np.diff(plain.slot_offsets)
    print(f"\nlong-tail synthetic: {args.documents:,} documents, lognormal median {args.median}, sigma {args.sigma}, "
          f"max-len {args.max_len}; documents a pack: median {int(np.median(per_pack))}, p99 "
          f"{int(np.percentile(per_pack, 99))}, max {per_pack.max()}\n")
    print("| K | packs | fill | more packs than uncapped |")
    print("|---:|---:|---:|---:|")
    tokens = int(lengths.sum())
    print(f"| none | {plain.packs:,} | {tokens / (plain.packs * args.max_len):.2%} | - |")
    for k in args.caps:
        packs = plan_packs(lengths, args.max_len, max_documents=k).packs
        print(f"| {k} | {packs:,} | {tokens / (packs * args.max_len):.2%} | {100 * (packs - plain.packs) / plain.packs:+.2f}% |")
    if args.build is not None:
        report = inspect_build(args.build, caps=args.caps)
        print(f"\n{args.build}: {report.packs:,} packs of {report.max_len}, fill {report.fill:.2%}; documents a pack: "
              f"median {report.documents_per_pack.p50:.0f}, p99 {report.documents_per_pack.p99:.0f}, max "
              f"{report.documents_per_pack.max:.0f}\n")
        print("| K | packs | fill | more packs than uncapped |")
        print("|---:|---:|---:|---:|")
        for c in report.caps:
            print(f"| {c.max_docs_per_pack} | {c.packs:,} | {c.fill:.2%} | {c.more_packs_percent:+.2f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--cap", type=int, default=24)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--caps-only", action="store_true")
    parser.add_argument("--caps", type=lambda text: [int(k) for k in text.split(",")], default=[8, 16, 32, 64, 128, 256])
    parser.add_argument("--build", type=Path, help="also price K on this build (prepack inspect --caps)")
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--median", type=float, default=40.0)
    parser.add_argument("--sigma", type=float, default=1.5)
    parser.add_argument("--caps-max-len", type=int, default=8192)
    args = parser.parse_args()
    if not args.caps_only:
        training_table(args)
    cap_table(argparse.Namespace(**{**vars(args), "max_len": args.caps_max_len}))


if __name__ == "__main__":
    main()
