"""DPO (or IPO, SimPO) on a preference-pair build with a plain PyTorch loop: pairs packed, exact; one
process, or DDP under torchrun.

    python examples/chitchat_pairs.py --out pairs-packed --max-len 2048       # or: prepack build ... --pairs
    python examples/train_dpo_plain_loop.py --data pairs-packed --steps 3 --loss dpo --beta 0.1
    python examples/train_dpo_plain_loop.py --data pairs-packed --reference pairs-reference   # stored reference
    torchrun --nproc_per_node 2 examples/train_dpo_plain_loop.py --data pairs-packed --accumulation 2

Each batch holds whole pairs (`prepack build --pairs` packs both documents of a pair together, and the
collator returns `pair_segments`). One forward of the policy and one of the frozen reference (a copy of
the starting model) over the packed batch give every completion's summed log-probability
(`prepack.training.preference.pair_logps`), exactly those of the sequences run alone. An optimizer step
is --accumulation batches on every rank, and every pair of it weighs the same: each batch's pair losses
are summed and divided by the pairs of the whole step (`dpo_step`: `loss_weights(batch, "pair")` and
`weighted_sum` of `prepack.training.loss`, the count all-reduced over the ranks), as that module does for
tokens. Packs hold different numbers of pairs (`prepack.training.loss` gives the chitchat build's), so
a mean per batch would weigh a pair by how few share its batch and rank. With --reference DIR the reference's log-probabilities are computed once, into DIR
(`prepack.training.reference.write_reference_logps`, by rank 0: a later run reuses them, a stopped one
goes on), and served with the packs: no reference model is held or run while training. Without --model
it trains a tiny random Llama built from a config (nothing is downloaded).
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from prepack import PackedCollator, PackedDataset, PackedSampler, enable_packing
from prepack.training.loss import loss_weights, weighted_sum
from prepack.training.preference import dpo_loss, ipo_loss, model_inputs, pair_logps, simpo_loss
from prepack.training.reference import stored_reference, write_reference_logps
from tiny_model import load_model, parse_args  # examples/tiny_model.py

LOSSES = {
    "dpo": lambda policy, reference, beta: dpo_loss(policy, reference, beta),
    "ipo": lambda policy, reference, beta: ipo_loss(policy, reference, beta),
    "simpo": lambda policy, reference, beta: simpo_loss(policy, beta),  # reference-free
}


def options(parser) -> None:
    parser.add_argument("--loss", choices=sorted(LOSSES), default="dpo")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--accumulation", type=int, default=1, help="batches (gradient accumulation steps) a step")
    parser.add_argument("--reference", help="a directory for the starting model's reference log-probabilities, "
                        "computed once (or finished) there, then read instead of running a reference model")


def dpo_step(model, reference, window: list[dict], loss: str, beta: float) -> tuple[float, float, int]:
    """The gradients of one optimizer step over `window`, this rank's micro-batches (`model` may be DDP):
    the mean of the `loss` of every pair of the step, on every rank. `reference` is None for stored
    reference log-probabilities. Returns the step's loss, reward accuracy and pairs, over every rank."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    weights = [loss_weights(batch, "pair") for batch in window]
    total = sum(w.sum() for w in weights)  # the step's pairs, here ...
    if world_size > 1:
        dist.all_reduce(total)  # ... and on every rank
    summary = torch.zeros(2, dtype=torch.float64, device=total.device)  # loss, reward accuracy
    for number, (batch, w) in enumerate(zip(window, weights)):
        last = number == len(window) - 1
        with model.no_sync() if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not last else contextlib.nullcontext():
            inputs = model_inputs(batch)  # the model takes no pair_segments
            policy = pair_logps(model(**inputs).logits, batch)
            if reference is None:
                reference_logps = stored_reference(batch)
            else:
                with torch.no_grad():
                    reference_logps = pair_logps(reference(**inputs).logits, batch)
            share = weighted_sum(LOSSES[loss](policy, reference_logps, beta), w, total)
            (share * world_size).backward()  # DDP averages the ranks' gradients
        won = policy.chosen - reference_logps.chosen > policy.rejected - reference_logps.rejected
        summary += torch.stack([share.detach(), weighted_sum(won.to(torch.float64), w, total)]).to(summary)
    if world_size > 1:
        dist.all_reduce(summary)
    return summary[0].item(), summary[1].item(), int(total.item())


def main() -> None:
    args = parse_args(__doc__, options)
    if "WORLD_SIZE" in os.environ:  # under torchrun: before PackedSampler, which takes its rank from here
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    dataset = PackedDataset(args.data)
    if dataset.manifest.pairs is None:
        raise SystemExit(f"{args.data} is not a preference-pair build: build it with prepack build ... --pairs")
    model = enable_packing(load_model(args.model, dataset)).to(device).train()
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    if args.reference:  # one pass of the frozen copy over the build, then it is let go
        if rank == 0:
            write_reference_logps(args.data, reference, args.reference, batch_size=args.batch_size)
        if dist.is_initialized():
            dist.barrier()  # the other ranks read what rank 0 wrote
        dataset, reference = PackedDataset(args.data, reference=args.reference), None
    if dist.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(model)
    sampler = PackedSampler(dataset, seed=0)  # this rank's packs, a new order each epoch
    collate = PackedCollator.for_dataset(dataset)  # pair_segments for a pair build, and reference_logps if stored
    loader = DataLoader(dataset, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=args.workers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step, window in zip(range(1, args.steps + 1), windows(loader, sampler, args.accumulation)):
        window = [{key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
                  for batch in window]
        loss, won, pairs = dpo_step(model, reference, window, args.loss, args.beta)
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss:.4f} pairs {pairs} reward accuracy {won:.2f}")
    print(f"final loss {loss:.4f}")
    if dist.is_initialized():
        # DDP's reducer goes before its process group, with every rank still here (examples/train_plain_loop.py).
        del model, optimizer
        dist.barrier()
        dist.destroy_process_group()


def windows(loader: DataLoader, sampler: PackedSampler, accumulation: int):
    """The batches of each optimizer step, `accumulation` at a time, epoch after epoch (each a new order);
    the last batches of an epoch that do not fill a step begin the next one's."""
    window = []
    while True:
        for batch in loader:
            window.append(batch)
            if len(window) == accumulation:
                yield window
                window = []
        sampler.set_epoch(sampler.epoch + 1)


if __name__ == "__main__":
    main()
