"""GRPO with a plain PyTorch loop on rollouts packed in memory: no files, and every rank plans the same micro-batches.

    python examples/rollouts_grpo_plain.py --steps 3
    python examples/rollouts_grpo_plain.py --steps 3 --whole-groups --iterations 2
    torchrun --nproc_per_node 2 examples/rollouts_grpo_plain.py --steps 3

Each step, every rank samples --group completions for each of its --prompts prompts (a tiny random Llama built from a
config: nothing is downloaded), scores them with a toy reward (the share of even token ids), and normalises the
rewards within each group: GRPO's advantages, one per sequence, carried as a per-token field. The ranks exchange
their rollouts, so that each holds the step's N sequences, and each computes the same `plan_rollouts` from their
lengths without further communication: micro-batches of at most --max-len tokens, as many on every rank, balanced by
the attention cost model with the model's own token cost (`model_token_cost`), a group kept in one micro-batch with
--whole-groups. Each rank then trains on its own micro-batches (`rollout_micro_batches`, PackedCollator's
padding-free rows, every sequence isolated).

The old policy's log-probabilities come from a no-grad forward over the plan's micro-batches, are stored with each
rollout as a per-token field (as a rollout engine's would be), and the update plans and collates again: the same
lengths give the same plan, so the first update's ratio is exactly 1 (printed as `ratio error`: its largest distance
from 1). Each rank prints a digest of each of its plans (`rank r step s plans ...`): equal on all ranks. A sequence's loss is the
mean clipped surrogate over its completion tokens (`policy_loss`), and the step's loss their mean over all N
sequences: every rank knows N, so no count is all-reduced. --iterations is GRPO's μ, updates on one generation.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM

from prepack import enable_packing, plan_rollouts, rollout_micro_batches
from prepack.building.balance import model_token_cost
from prepack.formats.shards import IGNORE_INDEX
from prepack.training.rollouts import policy_loss, sequence_sums, token_logps, trained

VOCAB, STOP = 128, 8  # a completion ends at its first token below STOP


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="prompts a rank samples for, each step")
    parser.add_argument("--group", type=int, default=4, help="completions a prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--max-len", type=int, default=128, help="tokens a micro-batch holds at most")
    parser.add_argument("--whole-groups", action="store_true", help="keep each prompt's G completions in one micro-batch")
    parser.add_argument("--iterations", type=int, default=1, help="updates on each generation (GRPO's mu)")
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--lr", type=float, default=1e-3)
    return parser.parse_args()


def sample_rollouts(model, prompts: int, group: int, max_new_tokens: int, generator: torch.Generator) -> list[dict]:
    """`prompts` × `group` rollouts: prompt tokens (labels -100), a sampled completion, its group's advantage."""
    rollouts = []
    for _ in range(prompts):
        prompt = torch.randint(STOP, VOCAB, (int(torch.randint(4, 17, (1,), generator=generator)),), generator=generator)
        with torch.no_grad():
            sampled = model.generate(prompt.repeat(group, 1), do_sample=True, max_new_tokens=max_new_tokens,
                                     min_new_tokens=max_new_tokens, pad_token_id=0, use_cache=True)
        completions = []
        for row in sampled[:, len(prompt) :]:
            stops = torch.nonzero(row < STOP)
            completions.append(row[: int(stops[0]) + 1] if len(stops) else row)
        rewards = torch.tensor([float((c % 2 == 0).double().mean()) for c in completions], dtype=torch.float64)
        advantages = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-4)
        for completion, reward, advantage in zip(completions, rewards, advantages):
            ids = torch.cat([prompt, completion]).numpy()
            labels = np.where(np.arange(len(ids)) < len(prompt), IGNORE_INDEX, ids)
            rollouts.append({"input_ids": ids, "labels": labels, "advantages": np.full(len(ids), float(advantage)),
                             "reward": float(reward)})
    return rollouts


def plan_digest(plan) -> str:
    return hashlib.sha256(plan.sequences.tobytes() + plan.offsets.tobytes()).hexdigest()[:16]


def store_old_logps(model, rollouts: list[dict], micro_batches) -> None:
    """Each of the micro-batches' rollouts gets `old_logps`, its tokens' log-probabilities under `model` now."""
    with torch.no_grad():
        for micro in micro_batches:
            logps = token_logps(model(**micro.batch).logits, micro.batch)[0]
            cu = micro.batch["cu_seq_lens_q"].tolist()
            for j, index in enumerate(micro.sequences):
                rollouts[index]["old_logps"] = logps[cu[j] : cu[j + 1]].numpy()


def main() -> None:
    args = parse_args()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.max_len)
    torch.manual_seed(0)  # the same initial weights on every rank
    policy = enable_packing(LlamaForCausalLM(config)).to(torch.float64)
    model = DistributedDataParallel(policy) if distributed else policy
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    token_cost = model_token_cost(config)
    generator = torch.Generator().manual_seed(1 + rank)
    for step in range(1, args.steps + 1):
        policy.eval()
        own = sample_rollouts(policy, args.prompts, args.group, args.max_new_tokens, generator)
        gathered = [None] * world_size
        if distributed:
            dist.all_gather_object(gathered, own)
        rollouts = [rollout for part in (gathered if distributed else [own]) for rollout in part]
        def plan():  # every rank, from the lengths alone
            return plan_rollouts([len(r["input_ids"]) for r in rollouts], args.max_len, world_size=world_size,
                                 cost="attention", token_cost=token_cost,
                                 group_sizes=[args.group] * (len(rollouts) // args.group) if args.whole_groups else None)

        policy.train()
        old_plan = plan()  # the old policy: before any update of this generation
        store_old_logps(model, rollouts, rollout_micro_batches(rollouts, old_plan, rank))
        update_plan = plan()
        print(f"rank {rank} step {step} plans {plan_digest(old_plan)} {plan_digest(update_plan)}", flush=True)
        micro_batches = rollout_micro_batches(rollouts, update_plan, rank, token_fields=("advantages", "old_logps"))
        for iteration in range(args.iterations):
            optimizer.zero_grad()
            total, ratio_error = torch.zeros((), dtype=torch.float64), 0.0
            for number, micro in enumerate(micro_batches):
                old_logps = micro.fields["old_logps"]
                last = number == len(micro_batches) - 1
                sync = model.no_sync() if distributed and not last else torch.enable_grad()
                with sync:
                    logps = token_logps(model(**micro.batch).logits, micro.batch)
                    per_token = policy_loss(logps, old_logps, micro.fields["advantages"], micro.batch, args.clip)
                    per_sequence = sequence_sums(per_token, micro) / sequence_sums(trained(micro.batch), micro).clamp(min=1)
                    loss = per_sequence.sum() / len(rollouts)  # the mean over the step's sequences, on all ranks
                    (loss * world_size).backward()  # DDP averages the ranks' gradients
                total += loss.detach()
                if iteration == 0:
                    mask = trained(micro.batch)
                    ratio_error = max(ratio_error, float((logps.detach() - old_logps)[mask].exp().sub(1).abs().max()))
            optimizer.step()
            if distributed:
                dist.all_reduce(total)
            if rank == 0:
                reward = np.mean([r["reward"] for r in rollouts])
                print(f"step {step}.{iteration + 1} sequences {len(rollouts)} micro-batches {update_plan.micro_batches} a rank "
                      f"reward {reward:.4f} loss {float(total):.6f}"
                      + (f" ratio error {ratio_error:.3g}" if iteration == 0 else ""), flush=True)
    if rank == 0:
        print(f"final loss {float(total):.6f}")
    if distributed:
        # Every rank reaches the end before any tears its group down: a rank that shut gloo down and exited while
        # another was still printing once left that one waiting in destroy_process_group (the suite's two-rank run).
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
