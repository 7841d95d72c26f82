"""What running the stateful layers one document at a time costs (`prepack.model.stateful`).

    python benchmarks/bench_per_document.py [--rows 4] [--max-len 1024] [--repeat 5] [--device cpu]

For a Bamba (Mamba-2 + attention), a Qwen3-Next (gated delta rule + attention, MoE) and an LFM2 (short
convolutions + attention) model of a few million random parameters, float32 on sdpa, it times one
forward + backward of the same packed batch two ways:

- `leaky`: the plain packed forward (position_ids only, use_cache=False, no enable_packing): attention
  is per document, the stateful layers run over whole rows, so documents leak into each other;
- `per_document`: `enable_packing` with PackedCollator's default batch: the stateful layers run on the
  batch regrouped into one row per segment, a call per band of similar lengths.

The batch: `--rows` rows of `--max-len` tokens, filled with documents of lognormal "SFT" lengths (median
~max_len/8) back to back, each row's tail left as padding. Prints the fastest of `--repeat` timed runs
each way, interleaved after one warm-up each, and the rows the length bands hold against B·L: the padding
the per-document layers pay.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from prepack import PackedCollator, disable_packing, enable_packing
from prepack.model.stateful import DocumentSegments

VOCAB = 1024
MODELS = {
    "bamba": dict(
        num_hidden_layers=4,
        attn_layer_indices=[3],
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=64,
        mamba_d_conv=4,
        mamba_chunk_size=64,
    ),
    "qwen3_next": dict(
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
    ),
    "lfm2": dict(num_hidden_layers=4, layer_types=["conv"] * 3 + ["full_attention"], conv_L_cache=3),
}
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=8192,
)


def packs(rows: int, max_len: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    result = []
    for _ in range(rows):
        lengths = []
        while True:
            length = int(np.clip(rng.lognormal(np.log(max_len / 8), 1.0), 1, max_len - 1))
            if sum(lengths) + length >= max_len:
                break
            lengths.append(length)
        tokens = sum(lengths)
        result.append(
            {
                "input_ids": rng.integers(1, VOCAB, size=tokens),
                "cu_seqlens": np.cumsum([0, *lengths], dtype=np.int32),
            }
        )
    return result


def step_seconds(model, batch: dict) -> float:
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    if batch["input_ids"].is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def fastest(model, leaky_batch: dict, batch: dict, repeat: int) -> tuple[float, float]:
    """The fastest of `repeat` runs each way, interleaved (one warm-up each), so a busy machine slows both."""
    leaky, per_document = [], []
    for _ in range(repeat + 1):
        leaky.append(step_seconds(disable_packing(model), leaky_batch))
        per_document.append(step_seconds(enable_packing(model), batch))
    return min(leaky[1:]), min(per_document[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    sample = packs(args.rows, args.max_len)
    batch = PackedCollator(args.max_len)(sample)
    segments = DocumentSegments(batch["cu_seq_lens_q"], tuple(batch["input_ids"].shape))
    tokens = batch["input_ids"].numel()
    documents = sum(len(pack["cu_seqlens"]) - 1 for pack in sample)
    count, longest = len(batch["cu_seq_lens_q"]) - 1, batch["max_length_q"]
    print(
        f"torch {torch.__version__}, {args.device}, float32 sdpa; {args.rows} rows x {args.max_len} tokens, "
        f"{documents} documents, {count} segments with the padding tails, longest {longest}; {segments.bands} "
        f"length bands holding {segments.grouped_tokens / tokens:.2f}x the batch's tokens (one band of the "
        f"longest: {count * longest / tokens:.2f}x)"
    )
    print("\n| model | parameters | leaky fwd+bwd s | per_document fwd+bwd s | ratio |\n|---|---:|---:|---:|---:|")
    on_device = {key: value.to(args.device) if torch.is_tensor(value) else value for key, value in batch.items()}
    leaky_batch = {key: on_device[key] for key in ("input_ids", "labels", "position_ids")} | {"use_cache": False}
    for family, config in MODELS.items():
        torch.manual_seed(0)
        options = dict(attn_implementation="sdpa", experts_implementation="eager")
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **SIZES | config), **options)
        model = model.to(args.device).train()
        leaky, per_document = fastest(model, leaky_batch, on_device, args.repeat)
        parameters = sum(parameter.numel() for parameter in model.parameters()) / 1e6
        print(f"| {family} | {parameters:.1f}M | {leaky:.3f} | {per_document:.3f} | {per_document / leaky:.2f} |")


if __name__ == "__main__":
    main()
