"""Groups of completions and KTO, packed, against their unpacked forms: token positions computed and CPU step time.

    python benchmarks/bench_groups.py                       # defaults: 24 groups of 4, 48 KTO examples
    python benchmarks/bench_groups.py --groups 128 --size 8 --examples 192 --repeats 3

Synthetic lengths (seed 0; prompts --prompt-min..--prompt-max tokens, completions --completion-min..max, ids
random below --vocab): what is measured depends on lengths only. Every path runs one step on a small random
Llama (2 layers, --hidden, float32, sdpa, CPU): the policy's forward and backward and a frozen reference's
forward, and prints the token positions the model computes and the median wall time over --repeats.

- Groups: packs of whole groups (first-fit, --max-len tokens), --pack-batch packs a batch, collated by
  `PackedCollator` as G documents a group (`padded`, rows of the batch's longest pack) and in the shared-prompt
  layout (each prompt once; rows of the batch's longest re-laid pack): like for like; the loss is DPO of the first completion against each
  other (examples/train_groups_plain_loop.py).
- KTO: TRL 1.16's KTOTrainer data path, batches of --batch-size examples each padded by
  `DataCollatorForUnpairedPreference` (the completion batch and the KL batch, each to its longest, TRL's KL
  completions cycled in the batch), against the same examples and KL completions packed as groups of 2 in the
  shared-prompt layout (`kto_groups`, `shared_prompt_layout`), one forward for both: each TRL batch's examples
  first-fit into rows of up to --max-len tokens, one layout a TRL batch, so that `kto_loss`'s KL estimate z is
  taken over the same examples as TRL's and the loss is TRL's (`tests/train/test_kto.py`). Prints markdown.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from prepack.model.packing import enable_packing
from prepack.training.collate import PackedCollator
from prepack.training.preference import GroupLogps, group_logps, kto_loss, model_inputs
from prepack.training.shared_prompt import Group, shared_prompt_layout
from prepack.training.unpaired import kl_partners, kto_groups


def tiny_llama(vocab: int, hidden: int, max_len: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def random_groups(rng, count: int, size: int, args) -> list[Group]:
    def tokens(low, high):
        return rng.integers(0, args.vocab, int(rng.integers(low, high + 1))).tolist()

    return [Group(tokens(args.prompt_min, args.prompt_max), [tokens(args.completion_min, args.completion_max) for _ in range(size)])
            for _ in range(count)]


def first_fit(units: list, lengths: list[int], max_len: int) -> list[list]:
    rows, room = [], []
    for unit, length in zip(units, lengths):
        for r, left in enumerate(room):
            if length <= left:
                rows[r].append(unit)
                room[r] -= length
                break
        else:
            rows.append([unit])
            room.append(max_len - length)
    return rows


def as_pack(groups: list[Group]) -> dict:
    """A pack of a group build: G documents a group (prompt + completion), labels -100 on the prompt."""
    documents = [np.array([*g.prompt, *c]) for g in groups for c in g.completions]
    labels = [np.array([-100] * len(g.prompt) + list(c)) for g in groups for c in g.completions]
    return {"input_ids": np.concatenate(documents), "labels": np.concatenate(labels),
            "cu_seqlens": np.cumsum([0, *map(len, documents)]).astype(np.int32),
            "pair_roles": np.tile(np.arange(len(groups[0].completions), dtype=np.uint8), len(groups))}


def timed(step, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def group_step(model, reference, batches: list[dict], beta: float = 0.1) -> None:
    for batch in batches:
        inputs = model_inputs(batch)
        policy = group_logps(model(**inputs).logits, batch)
        with torch.no_grad():
            ref = group_logps(reference(**inputs).logits, batch)
        margins = policy.logps - ref.logps
        (-torch.nn.functional.logsigmoid(beta * (margins[:, :1] - margins[:, 1:]))).mean().backward()
    model.zero_grad()


def trl_kto_step(model, reference, batches: list[dict], beta: float = 0.1) -> None:
    """TRL's KTOTrainer forwards: the completion batch (policy with grad, reference) and the KL batch (both
    without), the summed completion log-probabilities of each, then KTO's loss."""
    for batch in batches:
        sums = {}
        for prefix in ("", "KL_"):
            ids, mask, completion = (batch[f"{prefix}{k}"] for k in ("input_ids", "attention_mask", "completion_mask"))
            for name, net in (("policy", model), ("reference", reference)):
                with torch.set_grad_enabled(name == "policy" and prefix == ""):
                    logits = net(input_ids=ids, attention_mask=mask).logits[:, :-1]
                    logp = torch.log_softmax(logits.float(), -1).gather(2, ids[:, 1:, None])[..., 0]
                    sums[prefix, name] = (logp * completion[:, 1:]).sum(-1)
        policy = GroupLogps(torch.stack([sums["", "policy"], sums["KL_", "policy"]], 1), None)
        ref = GroupLogps(torch.stack([sums["", "reference"], sums["KL_", "reference"]], 1), None)
        kto_loss(policy, ref, batch["label"], beta).mean().backward()
    model.zero_grad()


def packed_kto_step(model, reference, batches: list[tuple[dict, torch.Tensor]], beta: float = 0.1) -> None:
    for batch, desirable in batches:
        policy = group_logps(model(**batch).logits, batch)
        with torch.no_grad():
            ref = group_logps(reference(**batch).logits, batch)
        kto_loss(policy, ref, desirable, beta).mean().backward()
    model.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--size", type=int, default=4)
    parser.add_argument("--examples", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=8, help="TRL's KTO batch (examples)")
    parser.add_argument("--pack-batch", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--prompt-min", type=int, default=20)
    parser.add_argument("--prompt-max", type=int, default=80)
    parser.add_argument("--completion-min", type=int, default=5)
    parser.add_argument("--completion-max", type=int, default=40)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    model = enable_packing(tiny_llama(args.vocab, args.hidden, args.max_len))
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads\n")

    groups = random_groups(rng, args.groups, args.size, args)
    # A group longer than max_len is left out, as --overflow drop leaves it.
    groups = [g for g in groups if args.size * len(g.prompt) + sum(map(len, g.completions)) <= args.max_len]
    lengths = [args.size * len(g.prompt) + sum(map(len, g.completions)) for g in groups]
    packs = [as_pack(row) for row in first_fit(groups, lengths, args.max_len)]
    chunks = [packs[i : i + args.pack_batch] for i in range(0, len(packs), args.pack_batch)]
    print(f"## Groups: {len(groups)} groups of {args.size}, {len(packs)} packs of up to {args.max_len} tokens, "
          f"{args.pack_batch} a batch\n")
    print("| layout | positions computed | step (s) |\n|---|---:|---:|")
    for name, options in (("G documents a group (padded, the batch's longest row)", {"pad_to": "longest"}),
                          ("shared prompt (padded, the batch's longest row)", {"shared_prompt": True})):
        batches = [PackedCollator(args.max_len, **options)(chunk) for chunk in chunks]
        positions = sum(b["input_ids"].numel() for b in batches)
        print(f"| {name} | {positions:,} | {timed(lambda: group_step(model, reference, batches), args.repeats):.3f} |")

    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    examples = random_groups(rng, args.examples, 1, args)
    prompts, completions = [g.prompt for g in examples], [g.completions[0] for g in examples]
    labels = rng.random(args.examples) < 0.5
    partners = kl_partners(args.examples, batch_size=args.batch_size)
    collate = DataCollatorForUnpairedPreference(pad_token_id=0)
    trl_batches = [collate([{"prompt_ids": prompts[i], "completion_ids": completions[i],
                             "KL_completion_ids": completions[int(partners[i])], "label": bool(labels[i])}
                            for i in range(s, min(s + args.batch_size, args.examples))])
                   for s in range(0, args.examples, args.batch_size)]
    kto = kto_groups(prompts, completions, partners)
    lengths = [len(g.prompt) + sum(map(len, g.completions)) for g in kto]
    packed, row_count = [], 0
    for start in range(0, args.examples, args.batch_size):  # one layout a TRL batch: z over the same examples
        batch = list(range(start, min(start + args.batch_size, args.examples)))
        rows = first_fit(batch, [lengths[i] for i in batch], args.max_len)
        order = [i for row in rows for i in row]  # group_logps' order: the layout's rows, in order
        packed.append((shared_prompt_layout([[kto[i] for i in row] for row in rows]), torch.as_tensor(labels[order])))
        row_count += len(rows)
    trl_positions = sum(b["input_ids"].numel() + b["KL_input_ids"].numel() for b in trl_batches)
    packed_positions = sum(b["input_ids"].numel() for b, _ in packed)
    print(f"\n## KTO: {args.examples} examples, TRL batches of {args.batch_size} (KL completions cycled in each)\n")
    print("| path | positions computed (a model's forward) | step (s) |\n|---|---:|---:|")
    print(f"| TRL KTOTrainer, padded completion and KL batches | {trl_positions:,} | "
          f"{timed(lambda: trl_kto_step(model, reference, trl_batches), args.repeats):.3f} |")
    print(f"| packed, shared prompt (completion and KL completion after one prompt), {row_count} rows | "
          f"{packed_positions:,} | {timed(lambda: packed_kto_step(model, reference, packed), args.repeats):.3f} |")


if __name__ == "__main__":
    main()
