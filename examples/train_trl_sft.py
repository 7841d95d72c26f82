"""Train on a prepack build with TRL's `SFTTrainer`, packing left to prepack.

    prepack build corpus.parquet --max-len 1024 --out packed/
    python examples/train_trl_sft.py --data packed/ --steps 3

What TRL 1.16 needs for rows that are already packed:
- `SFTTrainer` takes only a Hugging Face `datasets.Dataset`: `open_hf_dataset` checks every shard and
  returns the build as one (memory-mapped);
- `packing=False` and `dataset_kwargs={"skip_prepare_dataset": True}`: no tokenizing, truncating or
  packing again;
- `remove_unused_columns=False`, so that `cu_seqlens` reaches `PackedCollator`;
- a `processing_class`: TRL loads the model's tokenizer otherwise. The tiny random model gets a
  placeholder, since the rows are token ids already.
Without --model it trains a tiny random Llama built from a config (nothing is downloaded).
"""

from __future__ import annotations

import tempfile

import torch
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer

from prepack import PackedCollator, PackedDataset, enable_packing
from prepack.training.dataset import open_hf_dataset
from tiny_model import load_model, parse_args, placeholder_tokenizer, trainer_arguments  # examples/tiny_model.py


def main() -> None:
    args = parse_args(__doc__)
    packed = PackedDataset(args.data)
    model = enable_packing(load_model(args.model, packed))
    tokenizer = AutoTokenizer.from_pretrained(args.model) if args.model else placeholder_tokenizer()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(
                **trainer_arguments(args, output_dir),
                packing=False,
                bf16=torch.cuda.is_available(),  # TRL defaults to bf16, which needs a GPU here
                dataset_kwargs={"skip_prepare_dataset": True},
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
