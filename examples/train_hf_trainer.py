"""Train on a prepack build with the Hugging Face `Trainer`.

    prepack build corpus.parquet --max-len 1024 --out packed/
    python examples/train_hf_trainer.py --data packed/ --steps 3

The packs are already made, so the Trainer gets `PackedDataset` as it is and `PackedCollator` as its
data collator. `remove_unused_columns=False` matters: otherwise the Trainer drops every batch key that
is not a named argument of `model.forward`, the `cu_seq_lens_*` and `max_length_*` among them.
Without --model it trains a tiny random Llama built from a config (nothing is downloaded).
"""

from __future__ import annotations

import tempfile

from transformers import Trainer, TrainingArguments

from prepack import PackedCollator, PackedDataset, enable_packing
from tiny_model import load_model, parse_args, trainer_arguments  # examples/tiny_model.py


def main() -> None:
    args = parse_args(__doc__)
    dataset = PackedDataset(args.data)
    model = enable_packing(load_model(args.model, dataset))
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = Trainer(
            model=model,
            args=TrainingArguments(**trainer_arguments(args, output_dir)),
            train_dataset=dataset,
            data_collator=PackedCollator.for_dataset(dataset),
        )
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"final loss {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
