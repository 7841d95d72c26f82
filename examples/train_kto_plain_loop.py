"""KTO on unpaired feedback (TRL's format) with a plain PyTorch loop: each example's prompt once, then its
completion and its KL completion, exact.

    python examples/train_kto_plain_loop.py --data feedback.jsonl --tokenizer ./tok [--chat] --steps 3

The corpus holds `prompt`, `completion` and a boolean `label` a row (text, or conversations with --chat), read
and tokenized as TRL's KTOTrainer tokenizes it (`prepack.sources.pairs.unpaired_examples`). Each example's KL
completion, another example's completion, is planned once from --seed (`kl_partners`: one cycle through the
examples), and the examples are laid out in the shared-prompt layout as groups of 2 (`kto_groups`,
`shared_prompt_layout`): a completion and its KL completion both see the example's prompt and nothing else. A
step is --batch-size examples; `kto_loss` computes KTO's desirable and undesirable terms and the KL estimate over
them as TRL's KTOTrainer does over its batch, against a frozen copy of the starting model (so the first step's
loss is 0.5: σ(0) from either side). Without --model it trains a tiny random Llama built from a config (nothing
is downloaded).
"""

from __future__ import annotations

import copy

import torch

from prepack import enable_packing
from prepack.sources.corpus import find_corpus
from prepack.sources.pairs import unpaired_examples
from prepack.sources.tokenize import load_tokenizer
from prepack.training.preference import group_logps, kto_loss
from prepack.training.shared_prompt import shared_prompt_layout
from prepack.training.unpaired import kl_partners, kto_groups
from tiny_model import parse_args, tiny_llama  # examples/tiny_model.py


def options(parser) -> None:
    parser.add_argument("--tokenizer", required=True, help="a local tokenizer directory or tokenizer.json")
    parser.add_argument("--chat", action="store_true", help="the prompts and completions are conversations")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0, help="plans the KL completions")


def main() -> None:
    args = parse_args(__doc__, options)
    tokenizer = load_tokenizer(args.tokenizer)
    examples = unpaired_examples(find_corpus(args.data), tokenizer, chat=args.chat)
    groups = kto_groups(examples.prompts, examples.completions, kl_partners(len(examples.prompts), seed=args.seed))
    if args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model)
    else:
        longest = max(len(g.prompt) + max(map(len, g.completions)) for g in groups)
        model = tiny_llama(tokenizer.vocab_size, longest)
    model = enable_packing(model).train()
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(args.seed)).tolist()
    for step in range(1, args.steps + 1):
        first = (step - 1) * args.batch_size % len(groups)
        chosen = [order[(first + k) % len(groups)] for k in range(args.batch_size)]
        # The step's examples packed in one row, each prompt computed once.
        batch = shared_prompt_layout([[groups[i] for i in chosen]])
        desirable = torch.as_tensor(examples.desirable[chosen])
        policy = group_logps(model(**batch).logits, batch)
        with torch.no_grad():
            reference_logps = group_logps(reference(**batch).logits, batch)
        loss = kto_loss(policy, reference_logps, desirable, args.beta).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss.item():.4f} examples {len(chosen)} desirable {int(desirable.sum())}")
    print(f"final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
