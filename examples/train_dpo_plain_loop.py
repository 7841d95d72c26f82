"""DPO (or IPO, SimPO) on a preference-pair build with a plain PyTorch loop: pairs packed, exact.

    python examples/chitchat_pairs.py --out pairs-packed --max-len 2048       # or: prepack build ... --pairs
    python examples/train_dpo_plain_loop.py --data pairs-packed --steps 3 --loss dpo --beta 0.1
    python examples/train_dpo_plain_loop.py --data pairs-packed --reference pairs-reference   # stored reference

Each batch holds whole pairs (`prepack build --pairs` packs both documents of a pair together, and the
collator returns `pair_segments`). One forward of the policy and one of the frozen reference (a copy of
the starting model) over the packed batch give every completion's summed log-probability
(`prepack.training.preference.pair_logps`), exactly those of the sequences run alone; the loss is the
mean over the batch's pairs. With --reference DIR the reference's log-probabilities are computed once,
into DIR (`prepack.training.reference.write_reference_logps`: a later run reuses them, a stopped one goes
on), and served with the packs: no reference model is held or run while training. Without --model it
trains a tiny random Llama built from a config (nothing is downloaded).
"""

from __future__ import annotations

import copy

import torch
from torch.utils.data import DataLoader

from prepack import PackedCollator, PackedDataset, PackedSampler, enable_packing
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
    parser.add_argument("--reference", help="a directory for the starting model's reference log-probabilities, "
                        "computed once (or finished) there, then read instead of running a reference model")


def main() -> None:
    args = parse_args(__doc__, options)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dataset = PackedDataset(args.data)
    if dataset.manifest.pairs is None:
        raise SystemExit(f"{args.data} is not a preference-pair build: build it with prepack build ... --pairs")
    model = enable_packing(load_model(args.model, dataset)).to(device).train()
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    if args.reference:  # one pass of the frozen copy over the build, then it is let go
        write_reference_logps(args.data, reference, args.reference, batch_size=args.batch_size)
        dataset, reference = PackedDataset(args.data, reference=args.reference), None
    sampler = PackedSampler(dataset, seed=0)
    collate = PackedCollator.for_dataset(dataset)  # pair_segments for a pair build, and reference_logps if stored
    loader = DataLoader(dataset, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=args.workers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step = 0
    while step < args.steps:
        for batch in loader:
            batch = {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
            inputs = model_inputs(batch)  # the model takes no pair_segments
            policy = pair_logps(model(**inputs).logits, batch)
            if reference is None:
                reference_logps = stored_reference(batch)
            else:
                with torch.no_grad():
                    reference_logps = pair_logps(reference(**inputs).logits, batch)
            loss = LOSSES[args.loss](policy, reference_logps, args.beta).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            won = (policy.chosen - reference_logps.chosen > policy.rejected - reference_logps.rejected).float().mean()
            print(f"step {step} loss {loss.item():.4f} pairs {len(policy.chosen)} reward accuracy {won.item():.2f}")
            if step == args.steps:
                break
        sampler.set_epoch(sampler.epoch + 1)
    print(f"final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
