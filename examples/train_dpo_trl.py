"""DPO on a preference-pair build with TRL's `DPOTrainer`, packing left to prepack.

    python examples/chitchat_pairs.py --out pairs-packed --max-len 2048       # or: prepack build ... --pairs
    python examples/train_dpo_trl.py --data pairs-packed --steps 3
    python examples/train_dpo_trl.py --data pairs-packed --reference pairs-reference   # stored reference

TRL 1.16's DPOTrainer pads pairs itself and has no packed mode, so the recipe is a subclass with three
overrides (`PackedDPOTrainer`):
- `_prepare_dataset` returns the build as it is: `open_hf_dataset` gives it as a `datasets.Dataset`
  (memory-mapped, every shard checked), already tokenized and packed;
- `compute_loss` runs the policy and the reference over the packed batch and takes DPO's loss from
  `prepack.training.preference` (each completion's summed log-probability, exactly those of the
  sequences run alone; TRL's own loss code gives the same number in float64: tests/train/test_preference.py);
- `_get_num_items_in_batch` counts the pairs of the optimizer step, over its accumulated micro-batches and
  every rank, where Trainer counts trained tokens: `compute_loss` divides each micro-batch's summed pair
  losses by that count (`prepack.training.loss`, `loss_weights(batch, "pair")`), so every pair of a step
  weighs the same. Packs hold different numbers of pairs (`prepack.training.loss` gives the chitchat build's);
  TRL's own mean per micro-batch, averaged over --accumulation micro-batches and the ranks, would
  weigh a pair by how few share its micro-batch.
`PackedCollator` is the data collator (it adds `pair_segments`), `remove_unused_columns=False` lets the
packs' columns reach it, and the reference is passed as a frozen copy of the starting model.

With --reference DIR the starting model's reference log-probabilities are computed once, into DIR
(`write_reference_logps`: a later run reuses them, a stopped one goes on), and come with the packs
(`open_hf_dataset(..., reference=DIR)`); the loss takes them from the batch (`stored_reference`), and the
trainer holds no reference model: TRL's `precompute_ref_log_probs=True` with no `ref_model` keeps none
(under FSDP, TRL loads one and frees it when __init__ ends), and a third override,
`_precompute_ref_logps`, skips TRL's own pass over the data, since prepack stored the values already.

TRL's metrics (rewards, margins) are not logged. Without --model it trains a tiny random Llama built
from a config (nothing is downloaded).
"""

from __future__ import annotations

import copy
import tempfile

import torch
from transformers import AutoTokenizer
from trl import DPOConfig, DPOTrainer

from prepack import PackedCollator, PackedDataset, enable_packing
from prepack.training.dataset import open_hf_dataset
from prepack.training.loss import loss_weights, weighted_sum
from prepack.training.preference import dpo_loss, model_inputs, pair_logps
from prepack.training.reference import stored_reference, write_reference_logps
from tiny_model import load_model, parse_args, placeholder_tokenizer, trainer_arguments  # examples/tiny_model.py


class PackedDPOTrainer(DPOTrainer):
    """DPOTrainer on packs of whole pairs (`prepack build --pairs`), with a reference model or the
    stored reference log-probabilities (`precompute_ref_log_probs=True`). Every pair of an optimizer step
    weighs the same (module docstring)."""

    loss_is_scaled_for_ga = True  # compute_loss gives each micro-batch's share of the step's mean

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset  # tokenized and packed by prepack

    def _precompute_ref_logps(self, dataset, name, batch_size):
        return dataset  # its rows hold reference_logps: open_hf_dataset(..., reference=DIR)

    def _get_num_items_in_batch(self, batch_samples, device):
        """The pairs of the optimizer step: its micro-batches', on every rank."""
        pairs = sum((loss_weights(batch, "pair").sum() for batch in batch_samples), torch.zeros((), dtype=torch.float64))
        pairs = pairs.to(device)
        return self.accelerator.gather(pairs).sum() if self.args.world_size > 1 else pairs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        policy = pair_logps(model(**model_inputs(inputs)).logits, inputs)
        if self.precompute_ref_logps:
            reference = stored_reference(inputs)
        else:
            with torch.no_grad():
                reference = pair_logps(self.ref_model(**model_inputs(inputs)).logits, inputs)
        losses = dpo_loss(policy, reference, self.beta)
        if num_items_in_batch is None:  # evaluation: this batch's mean
            loss = losses.mean()
        else:  # this micro-batch's share of the step's mean, times the ranks, whose gradients DDP averages
            loss = weighted_sum(losses, loss_weights(inputs, "pair"), num_items_in_batch) * self.accelerator.num_processes
        return (loss, None) if return_outputs else loss


def options(parser) -> None:
    parser.add_argument("--reference", help="a directory for the starting model's reference log-probabilities, "
                        "computed once (or finished) there, then read instead of running a reference model")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches (gradient accumulation steps) a step")


def packed_dpo_trainer(args, model, ref_model, output_dir: str) -> PackedDPOTrainer:
    """The trainer of `model` on args.data: against `ref_model`, or, when it is None, against the
    reference log-probabilities stored in args.reference."""
    stored = ref_model is None
    return PackedDPOTrainer(
        model=model,
        ref_model=ref_model,
        args=DPOConfig(
            **trainer_arguments(args, output_dir),
            gradient_accumulation_steps=args.accumulation,
            precompute_ref_log_probs=stored,  # with no ref_model: TRL creates none
            bf16=torch.cuda.is_available(),  # TRL defaults to bf16, which needs a GPU here
            use_cpu=not torch.cuda.is_available(),  # under torchrun without GPUs: DDP over gloo, not one process each
        ),
        train_dataset=open_hf_dataset(args.data, reference=args.reference if stored else None),
        data_collator=PackedCollator.for_dataset(PackedDataset(args.data)),
        processing_class=AutoTokenizer.from_pretrained(args.model) if args.model else placeholder_tokenizer(),
    )


def main() -> None:
    args = parse_args(__doc__, options)
    packed = PackedDataset(args.data)
    if packed.manifest.pairs is None:
        raise SystemExit(f"{args.data} is not a preference-pair build: build it with prepack build ... --pairs")
    model = enable_packing(load_model(args.model, packed))
    if args.reference:  # one pass of the starting model over the build; no copy of it is made
        write_reference_logps(args.data, model.eval(), args.reference, batch_size=args.batch_size)
        ref_model = None
    else:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = packed_dpo_trainer(args, model, ref_model, output_dir)
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"final loss {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
