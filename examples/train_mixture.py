"""Train on a mixture build and log the loss of each source (a plain PyTorch loop, one process).

    prepack build mix.yaml --max-len 1024 --out packed/      # a mixture file: see README, "Mixtures"
    python examples/train_mixture.py --data packed/ --steps 3

Each pack carries the source of each of its documents (`source_ids`); the collator spreads them over
the tokens (`source_ids=True`), the loop pops them before the forward pass, and
`prepack.training.source_loss.source_losses` sums each source's token losses from the same logits the
model's loss comes from. Sums and counts add up over steps (and over ranks, with an all_reduce) before
they are divided. Without --model it trains a tiny random Llama built from a config (nothing is
downloaded).
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from prepack import PackedCollator, PackedDataset, PackedSampler, enable_packing
from prepack.training.source_loss import source_losses
from tiny_model import load_model, parse_args  # examples/tiny_model.py


def main() -> None:
    args = parse_args(__doc__)
    dataset = PackedDataset(args.data)
    if dataset.manifest.mixture is None:
        raise SystemExit(f"{args.data} is not a mixture build: build one from a mixture file (prepack build MIX.yaml).")
    names = [source.name for source in dataset.manifest.mixture.sources]
    loader = DataLoader(
        dataset,
        args.batch_size,
        sampler=PackedSampler(dataset, seed=0),
        collate_fn=PackedCollator.for_dataset(dataset, source_ids=True),
        num_workers=args.workers,
    )
    model = enable_packing(load_model(args.model, dataset)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sums, counts = torch.zeros(len(names), dtype=torch.float64), torch.zeros(len(names), dtype=torch.int64)
    for step, batch in zip(range(1, args.steps + 1), loader):
        sources = batch.pop("source_ids")  # the model takes no such argument
        output = model(**batch)
        output.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step_sums, step_counts = source_losses(output.logits.detach(), batch["labels"], sources, len(names))
        sums += step_sums
        counts += step_counts
        shown = ", ".join(f"{name} {s / c:.4f}" if c else f"{name} -" for name, s, c in zip(names, step_sums, step_counts))
        print(f"step {step} loss {output.loss.item():.4f} ({shown})")
    for name, s, c in zip(names, sums.tolist(), counts.tolist()):
        print(f"source {name} loss {s / c if c else float('nan'):.4f} over {c} tokens")
    print(f"final loss {output.loss.item():.4f}")


if __name__ == "__main__":
    main()
