"""Train a tiny random Llama on a build with one real client, as the README's recipes do, and record
which packs each rank trained on and what reached the model (`tests/train/test_clients.py` reads it).

    torchrun --nproc_per_node 2 tests/clients.py CLIENT --data BUILD --out DIR [--steps K]

CLIENT is `loop` (plain DDP over gloo with torchdata's StatefulDataLoader and PackedSampler),
`accelerate` (the same loop with the model and optimizer prepared by Accelerate), `hf` (HF Trainer)
or `trl` (TRL's SFTTrainer). Each trains three times from scratch, in phases: `epoch` (one whole
epoch), `first` (K steps, then the loader's or Trainer's state is saved in DIR, and training stops)
and `resumed` (new objects, loaded from that file, to the end of the epoch). Each rank writes
`DIR/CLIENT-PHASE-RANK.json`: `steps`, the dataset indices of the packs of each step; `kwargs`, what
the model's forward got besides tensors (use_cache, whether it had an attention_mask and offsets).
The model is never passed to `enable_packing`: the collated batch alone must keep documents apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))  # tiny_model.py

from prepack import PackedCollator, PackedDataset, PackedSampler  # noqa: E402
from tiny_model import load_model  # noqa: E402

BATCH_SIZE = 2
WORKERS = 2


class Record:
    """What the model's forward received, step by step, with each row mapped back to its pack."""

    def __init__(self, dataset: PackedDataset):
        # A row is its pack followed by padding (which repeats the pack's last token): the pack it begins with.
        self.pack_tokens = [dataset[i]["input_ids"].tobytes() for i in range(len(dataset))]
        self.steps: list[list[int]] = []
        self.kwargs: list[dict] = []

    def packs(self, input_ids: torch.Tensor) -> list[int]:
        """The dataset index of each row's pack."""
        return [self._pack_of(row.numpy().tobytes()) for row in input_ids.cpu().to(torch.int32)]

    def _pack_of(self, row: bytes) -> int:
        found = [index for index, tokens in enumerate(self.pack_tokens) if row.startswith(tokens)]
        assert len(found) == 1, f"the test build needs packs that are not prefixes of each other: {found}"
        return found[0]

    def hook(self, module, args, kwargs) -> None:
        self.steps.append(self.packs(kwargs["input_ids"]))
        self.kwargs.append(
            {
                "use_cache": kwargs.get("use_cache"),
                "attention_mask": kwargs.get("attention_mask") is not None,
                "cu_seq_lens_q": kwargs.get("cu_seq_lens_q") is not None,
            }
        )

    def write(self, path: Path) -> None:
        path.write_text(json.dumps({"steps": self.steps, "kwargs": self.kwargs}))


def stateful_loader(dataset: PackedDataset, sampler: PackedSampler):
    from torchdata.stateful_dataloader import StatefulDataLoader

    collate = PackedCollator.for_dataset(dataset)
    return StatefulDataLoader(dataset, BATCH_SIZE, sampler=sampler, collate_fn=collate, num_workers=WORKERS)


def run_loop(args, phase: str, dataset: PackedDataset, record: Record, rank: int, accelerator) -> None:
    """The README's loop: DDP, or Accelerate with the DataLoader left out of prepare()."""
    model = load_model(None, dataset)
    model.register_forward_pre_hook(record.hook, with_kwargs=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if accelerator is not None:
        model, optimizer = accelerator.prepare(model, optimizer)
        device, backward = accelerator.device, accelerator.backward
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        device, backward = torch.device("cpu"), torch.Tensor.backward
    sampler = PackedSampler(dataset, seed=0)
    loader = stateful_loader(dataset, sampler)
    state_file = Path(args.out) / f"{args.client}-state-{rank}.pt"
    if phase == "resumed":
        loader.load_state_dict(torch.load(state_file))
    for step, batch in enumerate(loader, start=1):
        batch = {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
        backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        if phase == "first" and step == args.steps:
            torch.save(loader.state_dict(), state_file)
            break


def check_accelerate_refuses_double_sharding(args, dataset, accelerator, rank: int) -> None:
    """The trap: a rank-aware sampler in a loader that Accelerate shards again; and the other recipe,
    an unsharded PackedSampler that Accelerate shards alone."""
    from torch.utils.data import DataLoader

    collate = PackedCollator.for_dataset(dataset)
    doubled = accelerator.prepare(DataLoader(dataset, BATCH_SIZE, sampler=PackedSampler(dataset), collate_fn=collate))
    try:
        next(iter(doubled))
        refused = None
    except RuntimeError as error:
        refused = str(error)
    alone = accelerator.prepare(
        DataLoader(dataset, BATCH_SIZE, sampler=PackedSampler(dataset, rank=0, world_size=1), collate_fn=collate)
    )
    record = Record(dataset)
    packs = [pack for batch in alone for pack in record.packs(batch["input_ids"])]
    Path(args.out, f"accelerate-sharding-{rank}.json").write_text(json.dumps({"refused": refused, "packs": packs}))


def run_trainer(args, phase: str, dataset: PackedDataset, record: Record) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = load_model(None, dataset)
    model.register_forward_pre_hook(record.hook, with_kwargs=True)
    options = dict(
        output_dir=str(Path(args.out) / f"{args.client}-run"),
        num_train_epochs=1,
        per_device_train_batch_size=BATCH_SIZE,
        learning_rate=1e-3,
        remove_unused_columns=False,
        dataloader_num_workers=WORKERS,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
    )
    collate = PackedCollator.for_dataset(dataset)

    class StopAfterSaving(TrainerCallback):
        def on_step_end(self, training_args, state, control, **kwargs):
            if phase == "first" and state.global_step == args.steps:
                control.should_save = control.should_training_stop = True

    common = dict(data_collator=collate, callbacks=[StopAfterSaving()])
    if args.client == "hf":
        trainer = Trainer(model=model, args=TrainingArguments(**options), train_dataset=dataset, **common)
    else:
        from trl import SFTConfig, SFTTrainer

        from prepack import open_hf_dataset
        from train_trl_sft import placeholder_tokenizer

        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(**options, packing=False, dataset_kwargs={"skip_prepare_dataset": True}, bf16=False),
            train_dataset=open_hf_dataset(args.data),
            processing_class=placeholder_tokenizer(),
            **common,
        )
    resume = None
    if phase == "resumed":
        [resume] = Path(options["output_dir"]).glob("checkpoint-*")
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("client", choices=["loop", "accelerate", "hf", "trl"])
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    rank = int(os.environ.get("RANK", "0"))
    dataset = PackedDataset(args.data)
    accelerator = None
    if args.client == "loop":
        # The other trap: a sampler built before init_process_group would be world size 1 on every rank.
        try:
            PackedSampler(dataset)
            early = None
        except RuntimeError as error:
            early = str(error)
        Path(args.out, f"loop-early-{rank}.json").write_text(json.dumps({"refused": early}))
        dist.init_process_group("gloo")
    elif args.client == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        check_accelerate_refuses_double_sharding(args, dataset, accelerator, rank)
    for phase in ("epoch", "first", "resumed"):
        record = Record(dataset)
        if args.client in ("loop", "accelerate"):
            run_loop(args, phase, dataset, record, rank, accelerator)
        else:
            run_trainer(args, phase, dataset, record)
        record.write(Path(args.out) / f"{args.client}-{phase}-{rank}.json")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
