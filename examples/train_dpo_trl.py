"""DPO on a preference-pair build with TRL's `DPOTrainer`, packing left to prepack.

    python examples/chitchat_pairs.py --out pairs-packed --max-len 2048       # or: prepack build ... --pairs
    python examples/train_dpo_trl.py --data pairs-packed --steps 3

TRL 1.16's DPOTrainer pads pairs itself and has no packed mode, so the recipe is a subclass with two
overrides (`PackedDPOTrainer`):
- `_prepare_dataset` returns the build as it is: `open_hf_dataset` gives it as a `datasets.Dataset`
  (memory-mapped, every shard checked), already tokenized and packed;
- `_compute_loss` runs the policy and the reference over the packed batch and takes DPO's loss from
  `prepack.training.preference` (each completion's summed log-probability, exactly those of the
  sequences run alone; TRL's own loss code gives the same number in float64: tests/train/test_preference.py).
`PackedCollator` is the data collator (it adds `pair_segments`), `remove_unused_columns=False` lets the
packs' columns reach it, and the reference is passed as a frozen copy of the starting model. TRL's
metrics (rewards, margins) are not logged. Without --model it trains a tiny random Llama built from a
config (nothing is downloaded).
"""

from __future__ import annotations

import copy
import tempfile

import torch
from transformers import AutoTokenizer
from trl import DPOConfig, DPOTrainer

from prepack import PackedCollator, PackedDataset, enable_packing
from prepack.training.dataset import open_hf_dataset
from prepack.training.preference import dpo_loss, model_inputs, pair_logps
from tiny_model import load_model, parse_args, placeholder_tokenizer  # examples/tiny_model.py


class PackedDPOTrainer(DPOTrainer):
    """DPOTrainer on packs of whole pairs (`prepack build --pairs`)."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset  # tokenized and packed by prepack

    def _compute_loss(self, model, inputs, return_outputs):
        inputs = dict(inputs)
        policy = pair_logps(model(**model_inputs(inputs)).logits, inputs)
        with torch.no_grad():
            reference = pair_logps(self.ref_model(**model_inputs(inputs)).logits, inputs)
        loss = dpo_loss(policy, reference, self.beta).mean()
        return (loss, None) if return_outputs else loss


def main() -> None:
    args = parse_args(__doc__)
    packed = PackedDataset(args.data)
    if packed.manifest.pairs is None:
        raise SystemExit(f"{args.data} is not a preference-pair build: build it with prepack build ... --pairs")
    model = enable_packing(load_model(args.model, packed))
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(args.model) if args.model else placeholder_tokenizer()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = PackedDPOTrainer(
            model=model,
            ref_model=reference,
            args=DPOConfig(
                output_dir=output_dir,
                bf16=torch.cuda.is_available(),  # TRL defaults to bf16, which needs a GPU here
                remove_unused_columns=False,
                max_steps=args.steps,
                per_device_train_batch_size=args.batch_size,
                learning_rate=args.lr,
                dataloader_num_workers=args.workers,
                logging_steps=1,
                save_strategy="no",
                report_to="none",
            ),
            train_dataset=open_hf_dataset(args.data),
            data_collator=PackedCollator.for_dataset(packed),
            processing_class=tokenizer,
        )
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"final loss {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
