"""KTO on an unpaired build with TRL's `KTOTrainer`, packing left to prepack.

    prepack build feedback.jsonl --unpaired --tokenizer ./tok --out kto-packed --max-len 2048 --overflow drop
    python examples/train_kto_trl.py --data kto-packed --steps 3
    python examples/train_kto_trl.py --data kto-packed --reference kto-reference   # stored reference

The build holds TRL's unpaired format (a prompt, a completion and a boolean label a row) tokenized as TRL's
KTOTrainer tokenizes it, each example packed whole with its KL completion (another example's completion after
this example's prompt, planned once from `--kl-seed`), and each example's label in the shards' `desirable` column.
TRL 1.16's KTOTrainer pads examples itself and pairs KL completions per batch, so the recipe is a subclass with
three overrides (`PackedKTOTrainer`), as examples/train_dpo_trl.py is for DPO:
- `_prepare_dataset` returns the build as it is: `open_hf_dataset` gives it as a `datasets.Dataset`
  (memory-mapped, every shard checked), tokenized, packed and its KL completions planned;
- `compute_loss` runs the policy and the reference over the packed batch and takes KTO's loss from
  `prepack.training.preference.kto_loss`: each example's completion and KL completion log-probabilities (exactly
  those of the sequences run alone), its label from the batch (`desirable`), TRL's desirable and undesirable terms
  and its KL estimate over the micro-batch's examples, as TRL takes it over its batch (tests/train/test_kto_build.py:
  equal to TRL's own loss code in float64);
- `_get_num_items_in_batch` counts the examples of the optimizer step, over its accumulated micro-batches and
  every rank: `compute_loss` divides each micro-batch's summed example losses by that count
  (`loss_weights(batch, "pair")`: an example is a pair of documents), so every example of a step weighs the same,
  whichever pack holds it.
`PackedCollator` is the data collator (it adds `pair_segments` and `desirable`), `remove_unused_columns=False`
lets the packs' columns reach it, and the reference is a frozen copy of the starting model. TRL refuses its KL
term without `train_sampling_strategy="sequential"` (its KL completions are its batch neighbours'); here they are
planned in the build, and the packs' order is the build's seeded shuffle, so the sequential sampler serves that.

With --reference DIR the starting model's reference log-probabilities (of every completion and KL completion) are
computed once, into DIR (`write_reference_logps`), and come with the packs (`open_hf_dataset(..., reference=DIR)`);
the trainer holds no reference model (`precompute_ref_log_probs=True` with no `ref_model`) and skips TRL's own
pass over the data (`_precompute_ref_logps`).

TRL's metrics (rewards, KL) are not logged. Without --model it trains a tiny random Llama built from a config
(nothing is downloaded); policy and reference start equal, so the first step's loss is 0.5 (σ(0)).
"""

from __future__ import annotations

import copy
import tempfile

import torch
from transformers import AutoTokenizer
from trl import KTOConfig, KTOTrainer

from prepack import PackedCollator, PackedDataset, enable_packing
from prepack.training.dataset import open_hf_dataset
from prepack.training.loss import loss_weights, weighted_sum
from prepack.training.preference import group_logps, kto_loss, model_inputs
from prepack.training.reference import stored_group_reference, write_reference_logps
from tiny_model import load_model, parse_args, placeholder_tokenizer, trainer_arguments  # examples/tiny_model.py


class PackedKTOTrainer(KTOTrainer):
    """KTOTrainer on packs of whole examples with their KL completions (`prepack build --unpaired`), with a
    reference model or the stored reference log-probabilities (`precompute_ref_log_probs=True`). Every example
    of an optimizer step weighs the same (module docstring)."""

    loss_is_scaled_for_ga = True  # compute_loss gives each micro-batch's share of the step's mean

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset  # tokenized, packed and its KL completions planned by prepack

    def _precompute_ref_logps(self, dataset, name, batch_size):
        return dataset  # its rows hold reference_logps: open_hf_dataset(..., reference=DIR)

    def _get_num_items_in_batch(self, batch_samples, device):
        """The examples of the optimizer step: its micro-batches', on every rank."""
        examples = sum((loss_weights(batch, "pair").sum() for batch in batch_samples), torch.zeros((), dtype=torch.float64))
        examples = examples.to(device)
        return self.accelerator.gather(examples).sum() if self.args.world_size > 1 else examples

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        policy = group_logps(model(**model_inputs(inputs)).logits, inputs)
        if self.precompute_ref_logps:
            reference = stored_group_reference(inputs)
        else:
            with torch.no_grad():
                reference = group_logps(self.ref_model(**model_inputs(inputs)).logits, inputs)
        losses = kto_loss(policy, reference, inputs["desirable"], self.beta, self.desirable_weight, self.undesirable_weight)
        if num_items_in_batch is None:  # evaluation: this batch's mean
            loss = losses.mean()
        else:  # this micro-batch's share of the step's mean, times the ranks, whose gradients DDP averages
            loss = weighted_sum(losses, loss_weights(inputs, "pair"), num_items_in_batch) * self.accelerator.num_processes
        return (loss, None) if return_outputs else loss


def options(parser) -> None:
    parser.add_argument("--reference", help="a directory for the starting model's reference log-probabilities, "
                        "computed once (or finished) there, then read instead of running a reference model")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches (gradient accumulation steps) a step")


def packed_kto_trainer(args, model, ref_model, output_dir: str) -> PackedKTOTrainer:
    """The trainer of `model` on args.data: against `ref_model`, or, when it is None, against the
    reference log-probabilities stored in args.reference."""
    stored = ref_model is None
    return PackedKTOTrainer(
        model=model,
        ref_model=ref_model,
        args=KTOConfig(
            **trainer_arguments(args, output_dir),
            gradient_accumulation_steps=args.accumulation,
            train_sampling_strategy="sequential",  # the build's seeded pack order (module docstring)
            precompute_ref_log_probs=stored,  # with no ref_model: TRL creates none
            bf16=torch.cuda.is_available(),  # TRL defaults to bf16, which needs a GPU here
            use_cpu=not torch.cuda.is_available(),
        ),
        train_dataset=open_hf_dataset(args.data, reference=args.reference if stored else None),
        data_collator=PackedCollator.for_dataset(PackedDataset(args.data)),
        processing_class=AutoTokenizer.from_pretrained(args.model) if args.model else placeholder_tokenizer(),
    )


def main() -> None:
    args = parse_args(__doc__, options)
    packed = PackedDataset(args.data)
    if packed.manifest.options.pairs is None or packed.manifest.options.pairs.kind != "unpaired":
        raise SystemExit(f"{args.data} is not an unpaired build: build it with prepack build ... --unpaired")
    model = enable_packing(load_model(args.model, packed))
    if args.reference:  # one pass of the starting model over the build; no copy of it is made
        write_reference_logps(args.data, model.eval(), args.reference, batch_size=args.batch_size)
        ref_model = None
    else:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = packed_kto_trainer(args, model, ref_model, output_dir)
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"final loss {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
