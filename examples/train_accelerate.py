"""Train on a prepack build with Accelerate, the DataLoader left to prepack.

    prepack build corpus.parquet --max-len 1024 --out packed/
    accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py --data packed/ --steps 3

`PackedSampler` gives each process its own packs, so the DataLoader stays out of
`accelerator.prepare()`: prepared, Accelerate would shard it a second time and the processes together
would train on half the data (PackedSampler refuses that before the first batch). Batches move to the
device by hand. The loader is torchdata's `StatefulDataLoader`, whose state resumes exactly (see
train_plain_loop.py; --checkpoint works the same here). Without --model it trains a tiny random Llama
built from a config (nothing is downloaded); on a machine without GPUs it runs on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator
from torchdata.stateful_dataloader import StatefulDataLoader

from prepack import PackedCollator, PackedDataset, PackedSampler, enable_packing
from tiny_model import load_model, parse_args  # examples/tiny_model.py
from train_plain_loop import epochs  # examples/train_plain_loop.py


def main() -> None:
    args = parse_args(__doc__)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # before PackedSampler: it sets up the ranks
    dataset = PackedDataset(args.data)
    sampler = PackedSampler(dataset, seed=0)
    collate = PackedCollator.for_dataset(dataset)
    loader = StatefulDataLoader(dataset, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=args.workers)
    state_file = Path(args.checkpoint, "loader.pt") if args.checkpoint else None
    if state_file and state_file.exists():
        loader.load_state_dict(torch.load(state_file))
    model = enable_packing(load_model(args.model, dataset)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)  # not the loader
    for step, batch in zip(range(1, args.steps + 1), epochs(loader, sampler)):
        batch = {key: value.to(accelerator.device) if torch.is_tensor(value) else value for key, value in batch.items()}
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.print(f"step {step} loss {loss.item():.4f}")
    if state_file and accelerator.is_main_process:
        state_file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(loader.state_dict(), state_file)
    accelerator.print(f"final loss {loss.item():.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
