"""KTO on an unpaired build with a plain PyTorch loop: each example's prompt once, then its completion and its
KL completion, exact.

    prepack build feedback.jsonl --unpaired --tokenizer ./tok [--chat] --overflow drop --max-len 2048 --out kto-packed
    python examples/train_kto_plain_loop.py --data kto-packed --steps 3

The corpus holds `prompt`, `completion` and a boolean `label` a row (text, or conversations with --chat), which
`prepack build --unpaired` tokenizes as TRL's KTOTrainer does and packs example by example: each example's
completion and its KL completion (another example's completion after this example's prompt, planned once from
--kl-seed: one cycle through the examples), its label in the shards' `desirable` column.
`PackedCollator(shared_prompt=True)` lays each example out as [prompt][completion][KL completion]: the prompt
computed once, each completion seeing it and itself only, so that `group_logps` gives both log-probabilities as
the sequences run alone. A step is --batch-size packs; `kto_loss` computes KTO's desirable and undesirable terms
and the KL estimate over the step's examples as TRL's KTOTrainer does over its batch (tests/train/test_kto_build.py),
against a frozen copy of the starting model (so the first step's loss is 0.5: σ(0) from either side). Without
--model it trains a tiny random Llama built from a config (nothing is downloaded).
"""

from __future__ import annotations

import copy

import torch
from torch.utils.data import DataLoader

from prepack import PackedCollator, PackedDataset, PackedSampler, enable_packing
from prepack.training.preference import group_logps, kto_loss, model_inputs
from tiny_model import load_model, parse_args  # examples/tiny_model.py


def options(parser) -> None:
    parser.add_argument("--beta", type=float, default=0.1)


def main() -> None:
    args = parse_args(__doc__, options)
    dataset = PackedDataset(args.data)
    if dataset.manifest.options.pairs is None or dataset.manifest.options.pairs.kind != "unpaired":
        raise SystemExit(f"{args.data} is not an unpaired build: build it with prepack build ... --unpaired")
    model = enable_packing(load_model(args.model, dataset)).train()
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    sampler = PackedSampler(dataset, seed=0)
    collate = PackedCollator.for_dataset(dataset, shared_prompt=True)
    loader = DataLoader(dataset, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=args.workers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step, batch in zip(range(1, args.steps + 1), loader):
        inputs = model_inputs(batch)
        policy = group_logps(model(**inputs).logits, batch)
        with torch.no_grad():
            reference_logps = group_logps(reference(**inputs).logits, batch)
        loss = kto_loss(policy, reference_logps, batch["desirable"], args.beta).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss.item():.4f} examples {len(batch['desirable'])} desirable {int(batch['desirable'].sum())}")
    print(f"final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
