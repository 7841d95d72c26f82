"""Train on a prepack build with the Hugging Face `Trainer`.

    prepack build corpus.parquet --max-len 1024 --out packed/
    python examples/train_hf_trainer.py --data packed/ --steps 3

The packs are already made, so the Trainer gets `PackedDataset` as it is and `PackedCollator` as its
data collator. `remove_unused_columns=False` matters: otherwise the Trainer drops every batch key that
is not a named argument of `model.forward`, the `cu_seq_lens_*` and `max_length_*` among them.
Without --model it trains a tiny random Llama built from a config (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import tempfile

from transformers import Trainer, TrainingArguments

from prepack import PackedCollator, PackedDataset, enable_packing
from tiny_model import load_model  # examples/tiny_model.py


def main() -> None:
    args = parse_args()
    dataset = PackedDataset(args.data)
    model = enable_packing(load_model(args.model, dataset))
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = Trainer(
            model=model,
            args=TrainingArguments(
                output_dir=output_dir,
                max_steps=args.steps,
                per_device_train_batch_size=args.batch_size,
                learning_rate=args.lr,
                remove_unused_columns=False,
                dataloader_num_workers=args.workers,
                logging_steps=1,
                save_strategy="no",
                report_to="none",
            ),
            train_dataset=dataset,
            data_collator=PackedCollator(max_len=dataset.manifest.options.max_len),
        )
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"final loss {losses[-1]:.4f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a directory written by `prepack build`")
    parser.add_argument("--model", help="a transformers causal LM name or path (default: tiny random Llama)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    return parser.parse_args()


if __name__ == "__main__":
    main()
