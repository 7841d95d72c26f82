"""prepack's collated batch through `enable_packing` on real CUDA attention kernels, in bfloat16: FlashAttention-4
(when the flash-attn-4 package is installed), torch's flex attention, sdpa and eager.

For each family (full attention, sliding windows, attention sinks) a tiny random model built from its config
runs a packed batch, and each document's logits must equal the document run alone within a bfloat16 tolerance.
Each case first runs a leak control: the same batch with a plain 0/1 `attention_mask` and no `enable_packing`,
which lets the documents of a row attend to each other and must differ by more than that tolerance, so the
comparison is shown able to fail on this very kernel. Skipped without CUDA; a (family, backend) pair that
prepack's table refuses is skipped with the refusal's reason, except the pairs measured isolating on an H200
(shared notes: FA4 on every family here, flex on Qwen3), where a refusal fails.

The shared-prompt layout of preference pairs (`PackedCollator(shared_prompt=True)`) on flex_attention, in
bfloat16 and float32: each pair's [prompt][chosen][rejected] batch gives, for every document, the logits of the
document run alone, and the same DPO loss and gradients as the unpacked pairs, within the dtype's tolerance. Its
leak control: a BlockMask that also lets each rejected completion see the chosen one must change the logits by
more than that tolerance.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, or_masks
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.utils import is_flash_attn_4_available

from prepack.model.packing import enable_packing
from prepack.model.shared_prompt import shared_prompt_block_mask
from prepack.training.collate import PackedCollator
from prepack.training.preference import PairLogps, dpo_loss, model_inputs, pair_logps
from prepack.errors import IsolationError
from prepack.model.isolation import default_tolerances, measure_isolation, random_packs
from tests.tiny_models import DOCUMENT_VOCAB, tiny_config
from tests.train.test_preference import BETA, VOCAB, batches, pair_build, pairs_of, small
from tests.train.test_shared_prompt import rejected_sees_chosen

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)"),
]

MAX_LEN = 128
# Kernel-friendly sizes: FA4 and flex take head dims of 16 and more (tiny_config's are 8). Windows stay
# tiny_config's (6 tokens), shorter than the documents, so that they are exercised.
KERNEL_SIZES = dict(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
FAMILIES = ("qwen3", "llama", "mistral", "gemma3_text", "gpt_oss")  # full, full, sliding, mixed, sinks + sliding
# flex compiles a kernel for each new shape (every document alone is one): two families keep it within minutes.
FLEX_FAMILIES = ("qwen3", "gemma3_text")
UNBUILDABLE = {("sdpa", "gpt_oss")}  # transformers has no sdpa path for GPT-OSS's attention sinks
MEASURED_ISOLATED = {("flash_attention_4", family) for family in FAMILIES} | {("flex_attention", "qwen3")}
TOLERANCE, _ = default_tolerances(torch.bfloat16, "sdpa")

CASES = [
    pytest.param(
        attn, family, id=f"{attn}-{family}",
        marks=[pytest.mark.skipif(not is_flash_attn_4_available(), reason="needs the flash-attn-4 package")]
        if attn == "flash_attention_4" else [],
    )
    for attn in ("flash_attention_4", "flex_attention", "sdpa", "eager")
    for family in (FLEX_FAMILIES if attn == "flex_attention" else FAMILIES)
    if (attn, family) not in UNBUILDABLE
]


def kernel_model(model_type: str, attn: str) -> torch.nn.Module:
    config = tiny_config(model_type)
    config.update(KERNEL_SIZES)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.bfloat16)
    return model.to("cuda").eval()


@pytest.mark.parametrize(("attn", "family"), CASES)
def test_packed_documents_stay_apart_on_cuda_kernels(attn, family):
    packs = random_packs(3, MAX_LEN, DOCUMENT_VOCAB, seed=0, labels=True)
    batch = PackedCollator(MAX_LEN)(packs)
    model = kernel_model(family, attn)
    binary_mask = PackedCollator(MAX_LEN, layout="indexed_mask")(packs)["attention_mask"].clamp(max=1)
    control = batch | {"attention_mask": binary_mask, "use_cache": False}
    leaky = measure_isolation(model, packs, control, tolerance=TOLERANCE, gradients=False)
    assert leaky.max_logit_diff > TOLERANCE, f"the leak control did not leak, so the test could not fail: {leaky}"
    try:
        enable_packing(model)
    except IsolationError as refused:
        if (attn, family) in MEASURED_ISOLATED:
            raise
        pytest.skip(f"prepack refuses {family} on {attn}: {refused}")
    result = measure_isolation(model, packs, batch, tolerance=TOLERANCE, gradients=False)
    assert result.passed, result


@pytest.fixture(scope="module")
def pairs_build(tmp_path_factory):
    return pair_build(tmp_path_factory.mktemp("pairs"))


def pair_llama(dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, num_hidden_layers=2, attn_implementation="flex_attention", **KERNEL_SIZES)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device="cuda", dtype=dtype).eval()


def on_cuda(batch: dict) -> dict:
    return {key: value.cuda() if torch.is_tensor(value) else value for key, value in batch.items()}


def shared_documents(logits: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    """The logits of a shared-prompt batch laid out as its documents, in pack order: for each pair, its prompt
    + chosen completion, then its prompt + rejected completion."""
    logits, ids = logits.flatten(0, 1), ids.flatten()
    documents = []
    for pair in range(1, int(ids.max()) // 3 + 1):
        prompt = logits[ids == 3 * pair]
        documents += [torch.cat([prompt, logits[ids == 3 * pair + part]]) for part in (1, 2)]
    return documents


def leak_control(model, window: list[dict], alone_logits: list[torch.Tensor], tolerance: float) -> None:
    """A BlockMask that also lets each rejected completion see its chosen one must move the logits."""
    with torch.no_grad():
        leaked = []
        for batch in window:
            ids = batch["shared_prompt_ids"]
            rows, width = ids.shape
            mask_mod = or_masks(shared_prompt_block_mask(ids, batch["shared_prompt_parts"]).mask_mod, rejected_sees_chosen(ids))
            mask = create_block_mask(mask_mod, rows, None, width, width, device=ids.device)
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=mask,
                           use_cache=False).logits
            leaked += shared_documents(logits, ids)
    largest = max((a - b).abs().max().item() for a, b in zip(leaked, alone_logits))
    assert largest > tolerance, f"the leak control did not leak ({largest:.3g}), so the test could not fail"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_shared_prompt_on_flex_attention_equals_unpacked_on_cuda(pairs_build, dtype):
    """Logits, the DPO loss (against a zero reference: no second model) and its gradients."""
    tolerance, loss_tolerance = default_tolerances(dtype, "flex_attention")
    model = enable_packing(pair_llama(dtype))
    parameters = list(model.parameters())
    window = [on_cuda(batch) for batch in batches(pairs_build, "padded", shared_prompt=True)]
    alone_logits, alone_sums = [], []
    for document in (document for pair in pairs_of(pairs_build) for document in pair):
        ids, labels = (small(column).cuda() for column in document)
        logits = model(input_ids=ids[None]).logits[0]
        logp = torch.log_softmax(logits[:-1].float(), -1).gather(1, ids[1:, None])[:, 0]
        alone_logits.append(logits.detach())
        alone_sums.append((logp * (labels[1:] != -100)).sum())
    leak_control(model, window, alone_logits, tolerance)
    shared_logits, shared_parts = [], []
    for batch in window:
        logits = model(**model_inputs(batch)).logits
        shared_logits += shared_documents(logits.detach(), batch["shared_prompt_ids"])
        shared_parts.append(pair_logps(logits, batch))
    assert len(shared_logits) == len(alone_logits)
    for got, expected in zip(shared_logits, alone_logits):
        torch.testing.assert_close(got, expected, rtol=0, atol=tolerance)
    shared = PairLogps(*(torch.cat(field) for field in zip(*shared_parts)))
    chosen, rejected = torch.stack(alone_sums[0::2]), torch.stack(alone_sums[1::2])
    unpacked = PairLogps(chosen, rejected, shared.chosen_tokens, shared.rejected_tokens)
    zero = PairLogps(*(torch.zeros_like(field) for field in shared))
    got, expected = (dpo_loss(logps, zero, BETA).mean() for logps in (shared, unpacked))
    torch.testing.assert_close(got, expected, rtol=0, atol=loss_tolerance)
    for name, a, b in zip(
        (name for name, _ in model.named_parameters()),
        torch.autograd.grad(got, parameters),
        torch.autograd.grad(expected, parameters),
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=loss_tolerance, msg=name)
