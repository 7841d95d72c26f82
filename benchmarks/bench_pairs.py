"""DPO on packed pairs against TRL 1.16's DPOTrainer data path, on the same pairs, in one run.

    python examples/chitchat_pairs.py --out pairs-packed --max-len 2048
    python benchmarks/bench_pairs.py --data pairs-packed --packs 16 --batch-size 8
    python benchmarks/bench_pairs.py --data pairs-packed --positions-only

The first --packs packs of a preference-pair build, and the pairs they hold. prepack: the packs in
batches of --pack-batch, collated `padding_free` (no padding at all), one policy and one reference
forward each, `pair_logps` and `dpo_loss`, the policy's backward; and the same with `shared_prompt=True`
(each pair's prompt computed once, both completions attending to it). TRL: the same pairs as TRL's DPOTrainer
feeds them, shuffled (seed 0) into batches of --batch-size pairs, each padded by its
`DataCollatorForPreference` (chosen and rejected together, to the batch's longest), the same forwards
and backward with the attention mask, and the loss of `DPOTrainer._compute_loss`'s formula on the
per-token log-probabilities. Both on a small random Llama (--hidden, 2 layers, float32, sdpa, CPU or the
GPU), token ids taken modulo --vocab so that the LM head does not dominate. Prints the token positions
each path computes, its median wall time over --repeats, and the ratios. Prints markdown.

First, over the whole build, the token positions `PackedCollator` lays out (what the model computes) in
batches of --pack-batch packs, in each layout with and without `shared_prompt`: `padded` with its default
rows (the build's max_len; with shared_prompt the batch's longest re-laid pack), `padded` with
pad_to="max_len", and `padding_free`. --positions-only stops there (no model is run).
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from trl.trainer.dpo_trainer import DataCollatorForPreference

from prepack.model.packing import enable_packing
from prepack.training.collate import PackedCollator
from prepack.training.dataset import PackedDataset
from prepack.training.preference import dpo_loss, model_inputs, pair_logps


def tiny_llama(vocab: int, hidden: int, max_len: int, device: torch.device) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device)


def packed_step(model, reference, batches, device) -> None:
    for batch in batches:
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        policy = pair_logps(model(**model_inputs(batch)).logits, batch)
        with torch.no_grad():
            ref = pair_logps(reference(**model_inputs(batch)).logits, batch)
        dpo_loss(policy, ref).mean().backward()


def trl_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion log-probabilities of TRL's batch ([chosen; rejected] rows), as `_compute_loss` sums them."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits[:, :-1]
    mask = batch["completion_mask"][:, 1:]
    logp = torch.log_softmax(logits.float(), -1).gather(2, batch["input_ids"][:, 1:, None])[..., 0]
    return (logp * mask).sum(1).chunk(2)


def trl_step(model, reference, batches, device) -> None:
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        chosen, rejected = trl_logps(model, batch)
        with torch.no_grad():
            ref_chosen, ref_rejected = trl_logps(reference, batch)
        (-F.logsigmoid(0.1 * ((chosen - ref_chosen) - (rejected - ref_rejected)))).mean().backward()


def positions_by_layout(dataset: PackedDataset, pack_batch: int) -> list[tuple[str, int, int]]:
    """(layout, positions of the two-sequence layout, of the shared-prompt one) over every pack of `dataset`."""
    packs = [dataset[i] for i in range(len(dataset))]
    rows = []
    for name, options in (("padded (default rows)", {}), ('padded, pad_to="max_len"', {"pad_to": "max_len"}),
                          ("padding_free", {"layout": "padding_free"})):
        counts = []
        for shared_prompt in (False, True):
            collate = PackedCollator.for_dataset(dataset, shared_prompt=shared_prompt, **options)
            counts.append(sum(collate(packs[first : first + pack_batch])["input_ids"].numel()
                              for first in range(0, len(packs), pack_batch)))
        rows.append((name, *counts))
    return rows


def timed(step, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a preference-pair build (prepack build --pairs)")
    parser.add_argument("--packs", type=int, default=16)
    parser.add_argument("--pack-batch", type=int, default=2, help="packs per prepack batch")
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per TRL batch (DPOConfig's default)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--positions-only", action="store_true", help="print the positions by layout, run no model")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dataset = PackedDataset(args.data)
    max_len = dataset.manifest.options.max_len
    print(f"Token positions over the whole of {args.data} ({len(dataset):,} packs of {max_len:,}, "
          f"{dataset.manifest.totals.tokens:,} tokens), {args.pack_batch} packs a batch\n")
    print("| layout | two sequences a pair | shared prompt | saved |")
    print("|---|---:|---:|---:|")
    for name, two_sequences, shared_prompt in positions_by_layout(dataset, args.pack_batch):
        print(f"| {name} | {two_sequences:,} | {shared_prompt:,} | {1 - shared_prompt / two_sequences:.1%} |")
    print()
    if args.positions_only:
        return
    packs = [dataset[i] for i in range(min(args.packs, len(dataset)))]
    packed, shared = ([], [])
    for batches, collate in ((packed, PackedCollator(max_len, layout="padding_free")),
                             (shared, PackedCollator(max_len, layout="padding_free", shared_prompt=True))):
        for first in range(0, len(packs), args.pack_batch):
            batch = collate(packs[first : first + args.pack_batch])
            batch["input_ids"] = batch["input_ids"] % args.vocab
            batch["labels"] = torch.where(batch["labels"] == -100, batch["labels"], batch["labels"] % args.vocab)
            batches.append(batch)
    examples = []
    for pack in packs:
        cu, ids, labels = pack["cu_seqlens"], pack["input_ids"] % args.vocab, pack["labels"]
        for j in range(0, len(cu) - 1, 2):
            chosen, rejected = ids[cu[j] : cu[j + 1]], ids[cu[j + 1] : cu[j + 2]]
            prompt = int(np.flatnonzero(labels[cu[j] : cu[j + 1]] != -100)[0])
            examples.append({"prompt_ids": chosen[:prompt].tolist(), "chosen_ids": chosen[prompt:].tolist(),
                             "rejected_ids": rejected[prompt:].tolist()})
    order = np.random.default_rng(0).permutation(len(examples))
    trl_collate = DataCollatorForPreference(pad_token_id=0)
    trl = [trl_collate([examples[i] for i in order[first : first + args.batch_size]])
           for first in range(0, len(order), args.batch_size)]

    model = enable_packing(tiny_llama(args.vocab, args.hidden, max_len, device))
    reference = copy.deepcopy(model).requires_grad_(False)
    plain, plain_reference = tiny_llama(args.vocab, args.hidden, max_len, device), None
    plain_reference = copy.deepcopy(plain).requires_grad_(False)
    packed_step(model, reference, packed[:1], device)  # warm-up
    packed_step(model, reference, shared[:1], device)
    trl_step(plain, plain_reference, trl[:1], device)
    packed_time = timed(lambda: packed_step(model, reference, packed, device), args.repeats)
    shared_time = timed(lambda: packed_step(model, reference, shared, device), args.repeats)
    trl_time = timed(lambda: trl_step(plain, plain_reference, trl, device), args.repeats)
    real = sum(len(pack["input_ids"]) for pack in packs)
    packed_tokens = sum(batch["input_ids"].numel() for batch in packed)
    shared_tokens = sum(batch["input_ids"].numel() for batch in shared)
    trl_tokens = sum(batch["input_ids"].numel() for batch in trl)

    where = torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    print(f"{len(examples):,} pairs ({real:,} tokens) of {args.data}, first {len(packs)} packs of {max_len:,}; "
          f"Llama 2 layers, hidden {args.hidden}, vocab {args.vocab}, float32, sdpa, {where}; median of {args.repeats}\n")
    print("| data path | batches | token positions | × real tokens | fwd+bwd s (policy + reference) | × prepack |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| prepack packed pairs, {args.pack_batch} packs a batch, padding_free | {len(packed)} | {packed_tokens:,} | "
          f"{packed_tokens / real:.2f} | {packed_time:.2f} | 1.00 |")
    print(f"| prepack, shared prompt (each prompt once), {args.pack_batch} packs a batch | {len(shared)} | {shared_tokens:,} | "
          f"{shared_tokens / real:.2f} | {shared_time:.2f} | {shared_time / packed_time:.2f} |")
    print(f"| TRL DataCollatorForPreference, {args.batch_size} pairs a batch | {len(trl)} | {trl_tokens:,} | "
          f"{trl_tokens / real:.2f} | {trl_time:.2f} | {trl_time / packed_time:.2f} |")


if __name__ == "__main__":
    main()
