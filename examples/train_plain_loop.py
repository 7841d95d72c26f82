"""Train on a prepack build with a plain PyTorch loop.

    prepack build corpus.parquet --max-len 1024 --out packed/
    python examples/train_plain_loop.py --data packed/ --steps 3

Without --model it trains a tiny random Llama built from a config (nothing is downloaded).
"""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import DataLoader

from prepack import PackedCollator, PackedDataset, PackedSampler, enable_packing
from tiny_model import load_model, parse_args  # examples/tiny_model.py


def main() -> None:
    args = parse_args(__doc__)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dataset = PackedDataset(args.data)
    sampler = PackedSampler(dataset, seed=0)
    collate = PackedCollator(max_len=dataset.manifest.options.max_len)  # pads every row to max_len
    loader = DataLoader(dataset, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=args.workers)
    model = enable_packing(load_model(args.model, dataset)).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step, batch in zip(range(1, args.steps + 1), epochs(loader, sampler)):
        batch = {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
        loss = model(**batch).loss  # enable_packing sets use_cache=False: with a cache, sdpa/eager would leak
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss.item():.4f}")
    print(f"final loss {loss.item():.4f}")


def epochs(loader: DataLoader, sampler: PackedSampler):
    """Batches epoch after epoch, each epoch in a new order."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


if __name__ == "__main__":
    main()
