"""Train on a prepack build with a plain PyTorch loop: one process, or DDP under torchrun.

    prepack build corpus.parquet --max-len 1024 --out packed/
    python examples/train_plain_loop.py --data packed/ --steps 3
    torchrun --nproc_per_node 2 examples/train_plain_loop.py --data packed/ --steps 3 --checkpoint ckpt/

torchdata's `StatefulDataLoader` saves, with `state_dict()`, where the loop is: at the last batch it
handed out, however far its workers have read ahead. With --checkpoint, the loader's state is saved
there after the last step and loaded again on the next run, which goes on with exactly the next
untrained batch, on this number of processes or another. Without --model it trains a tiny random
Llama built from a config (nothing is downloaded).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from prepack import PackedCollator, PackedDataset, PackedSampler, enable_packing
from tiny_model import load_model, parse_args  # examples/tiny_model.py


def main() -> None:
    args = parse_args(__doc__)
    if "WORLD_SIZE" in os.environ:  # under torchrun: before PackedSampler, which takes its rank from here
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    dataset = PackedDataset(args.data)
    sampler = PackedSampler(dataset, seed=0)  # this rank's packs, a new order each epoch
    collate = PackedCollator.for_dataset(dataset)  # pads every row to the build's max_len
    loader = StatefulDataLoader(dataset, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=args.workers)
    state_file = Path(args.checkpoint, "loader.pt") if args.checkpoint else None
    if state_file and state_file.exists():
        loader.load_state_dict(torch.load(state_file))  # rank 0's: every rank's says how far the job got
    model = enable_packing(load_model(args.model, dataset)).to(device).train()
    if dist.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step, batch in zip(range(1, args.steps + 1), epochs(loader, sampler)):
        batch = {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
        loss = model(**batch).loss  # the batch says use_cache=False: with a cache, sdpa/eager would leak
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss.item():.4f}")
    if state_file and rank == 0:
        state_file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(loader.state_dict(), state_file)  # with the model's and optimizer's, in a real job
    print(f"final loss {loss.item():.4f}")
    if dist.is_initialized():
        # DDP's reducer goes before its process group, with every rank still here: in the other order gloo
        # now and then waits forever at exit on a rank that has already left (tests/train/test_loss.py).
        del model, optimizer
        dist.barrier()
        dist.destroy_process_group()


def epochs(loader: StatefulDataLoader, sampler: PackedSampler):
    """Batches epoch after epoch, each in a new order. A loaded state reaches the sampler when the
    loader starts, so a resumed run first finishes the epoch it was saved in."""
    while True:
        yield from loader
        sampler.set_epoch(sampler.epoch + 1)


if __name__ == "__main__":
    main()
