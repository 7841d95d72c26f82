"""Groups of completions (best-of-N samples, rejection sampling, ranked responses) in the shared-prompt layout, a
plain PyTorch loop.

    prepack build samples.jsonl --tokenizer ./tok --groups --overflow truncate --max-len 2048 --out groups-packed
    python examples/train_groups_plain_loop.py --data groups-packed --steps 3
    prepack build ranked.jsonl --tokenizer ./tok --groups --ranks-column ranks --overflow drop --max-len 2048 --out ranked
    python examples/train_groups_plain_loop.py --data ranked --steps 3

The corpus holds a prompt and a list of G completions a row, the first the best (the one kept by rejection
sampling); `prepack build --groups` packs each group whole. `PackedCollator(shared_prompt=True)` lays every
group out as [prompt][c1]…[cG]: the prompt computed once, each completion seeing it and itself only, so that
`group_logps` gives each completion's summed log-probability exactly as prompt + completion run alone. The
loss here is DPO of the first completion against each of the others, the mean over a step's (group, other)
pairs, against a frozen copy of the starting model (so the first step's loss is log 2).

A build with ranks (`--ranks-column`: G integers a row, 1 the best) gives every batch `group_ranks` [groups, G],
in the rows of `group_logps`; the loss is then `plackett_luce_loss`, DPO under the Plackett-Luce model of each
group's whole ranking (the DPO paper's Appendix A.3), whose first step is log G!. That model takes a strict
ranking: the build accepts ties ("1224"), this example needs ranks without ties (each of 1 … G once) and
refuses a batch that holds a tie before computing it. (A build with
`--scores-column` gives `group_scores` the same way, for a loss of your own.) Without --model it trains a tiny
random Llama built from a config (nothing is downloaded).
"""

from __future__ import annotations

import copy

import torch
from torch.utils.data import DataLoader

from prepack import PackedCollator, PackedDataset, PackedSampler, enable_packing
from prepack.errors import UsageError
from prepack.training.preference import group_logps, model_inputs, plackett_luce_loss, ranking_order
from tiny_model import load_model, parse_args  # examples/tiny_model.py


def options(parser) -> None:
    parser.add_argument("--beta", type=float, default=0.1)


def best_against_others(policy, reference, beta: float) -> torch.Tensor:
    """[P, G - 1]: -log σ(β ((π₀ - ref₀) - (πₖ - refₖ))) for the first completion of each group against each other."""
    margins = policy.logps - reference.logps
    return -torch.nn.functional.logsigmoid(beta * (margins[:, :1] - margins[:, 1:]))


def main() -> None:
    args = parse_args(__doc__, options)
    dataset = PackedDataset(args.data)
    if dataset.manifest.options.pairs is None or dataset.manifest.options.pairs.group_size is None:
        raise SystemExit(f"{args.data} is not a group build: build it with prepack build ... --groups")
    model = enable_packing(load_model(args.model, dataset)).train()
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    sampler = PackedSampler(dataset, seed=0)
    collate = PackedCollator.for_dataset(dataset, shared_prompt=True)
    loader = DataLoader(dataset, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=args.workers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step, batch in zip(range(1, args.steps + 1), loader):
        if "group_ranks" in batch:  # Plackett-Luce takes no ties: refuse them before the forward passes
            try:
                ranking_order(batch["group_ranks"])
            except UsageError as error:
                raise SystemExit(f"{args.data}, batch {step}: {error} This example needs ranks without ties.") from None
        inputs = model_inputs(batch)
        policy = group_logps(model(**inputs).logits, batch)
        with torch.no_grad():
            reference_logps = group_logps(reference(**inputs).logits, batch)
        if "group_ranks" in batch:  # a build with --ranks-column: learn each group's whole ranking
            loss = plackett_luce_loss(policy, reference_logps, batch["group_ranks"], args.beta).mean()
        else:
            loss = best_against_others(policy, reference_logps, args.beta).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss.item():.4f} groups {policy.logps.shape[0]} of {policy.logps.shape[1]}")
    print(f"final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
