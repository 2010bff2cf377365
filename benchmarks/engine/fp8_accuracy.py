"""Accuracy of FP8 weights (`--quantization fp8`, per channel or in blocks), an FP8 KV cache
(`--kv-cache-dtype fp8`) and both, against the unquantized model, on the embedded SmolLM2-135M (real
weights), on CPU.

    python -m sluice.benchmarks.engine.fp8_accuracy [--json out.json]

On CPU FP8 runs the emulation (`sluice.engine.worker.layers.fp8_linear`: e4m3 weights and per-token e4m3
activations multiplied in fp32, the numerics of `torch._scaled_mm` on a GPU): the figures are accuracy, not
speed. The reference is the same engine in float32 with neither; a bfloat16 row (no FP8) shows how much a
change of float rounding alone moves these measures on this model.

  * logits on fixed text: 4 passages of the Python 3 language reference that CPython ships
    (`pydoc_data.topics`: execution model, import system, customization, standard types), 512 tokens each,
    teacher-forced in steps of 128 tokens (FP8's per-token activation scales make a step's rows
    independent, so this is what decode computes; the KV cache holds every earlier token): top-1 agreement
    with the reference over all 2,048 positions, max and mean |logit - reference logit|;
  * greedy: 4 chat prompts x 64 tokens: sequences equal to the reference's, and the equal prefixes.
"""

from __future__ import annotations

import argparse
import json

import torch

from sluice.benchmarks.engine.quant_accuracy import common_prefix, greedy
from sluice.engine.frontend.llm import LLM
from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.input_batch import build_model_inputs

TOPICS = ("execmodel", "import", "customization", "types")
TOKENS_PER_PASSAGE = 512
STEP = 128
CONFIGS = {
    "bf16 (context)": {"dtype": "bfloat16"},  # no FP8: what a change of float rounding alone does
    "fp8 weights": {"quantization": "fp8"},
    "fp8 KV": {"kv_cache_dtype": "fp8"},
    "fp8 weights + KV": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
    # the block-wise layout (`--fp8-weight-block`): SmolLM2's 576-row q is whole blocks of 64, not of 128
    "fp8 weights, 64-blocks": {"quantization": "fp8", "fp8_weight_block": 64},
    "fp8 weights, 16-blocks": {"quantization": "fp8", "fp8_weight_block": 16},
}


def passages(llm: LLM) -> list[list[int]]:
    """The first TOKENS_PER_PASSAGE tokens of each TOPICS passage."""
    from pydoc_data.topics import topics

    return [llm.tokenizer.encode(topics[name])[:TOKENS_PER_PASSAGE] for name in TOPICS]


@torch.inference_mode()
def teacher_forced_logits(llm: LLM, token_ids: list[int], step: int = STEP) -> torch.Tensor:
    """[len(token_ids), vocab] float32: the whole stack (`runner.forward`) over `token_ids`, `step` tokens
    a step, every row's logits."""
    runner = llm.engine.model_runner
    blocks = tuple(range(-(-len(token_ids) // runner.block_size)))
    rows = []
    for start in range(0, len(token_ids), step):
        chunk = tuple(token_ids[start : start + step])
        out = SchedulerOutput((ScheduledRequest("text", chunk, start, blocks, False),), len(chunk))
        inputs = build_model_inputs(out, runner.block_size, runner.device)
        hidden = runner.forward(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.metadata)
        rows.append(runner.model.compute_logits(hidden))
    return torch.cat(rows)


def measure(llm: LLM, texts: list[list[int]], ref_logits: torch.Tensor, ref_greedy, max_tokens: int) -> dict:
    logits = torch.cat([teacher_forced_logits(llm, text) for text in texts])
    error = (logits - ref_logits).abs()
    outputs = greedy(llm, max_tokens)
    return {
        "positions": logits.shape[0],
        "top1_agreement": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
        "max_logit_error": error.max().item(),
        "mean_logit_error": error.mean().item(),
        "max_abs_logit": ref_logits.abs().max().item(),
        "greedy_equal": sum(a == b for a, b in zip(outputs, ref_greedy, strict=True)),
        "greedy_sequences": len(outputs),
        "greedy_equal_prefixes": [common_prefix(a, b) for a, b in zip(outputs, ref_greedy, strict=True)],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.benchmarks.engine.fp8_accuracy", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    reference = LLM(dtype="float32", enable_prefix_caching=False)
    texts = passages(reference)
    ref_logits = torch.cat([teacher_forced_logits(reference, text) for text in texts])
    ref_greedy = greedy(reference, args.max_tokens)
    del reference
    print(f"text: {len(texts)} x {TOKENS_PER_PASSAGE} tokens; greedy: 4 chat prompts x {args.max_tokens}")
    print(
        f"{'config':<18} {'top-1':>7} {'max |err|':>10} {'rel':>6} {'mean |err|':>10}  greedy equal, prefixes"
    )
    results = {}
    for name in args.configs:
        llm = LLM(**{"dtype": "float32", "enable_prefix_caching": False, **CONFIGS[name]})
        row = results[name] = measure(llm, texts, ref_logits, ref_greedy, args.max_tokens)
        del llm
        print(
            f"{name:<18} {row['top1_agreement']:>7.2%} {row['max_logit_error']:>10.3f} "
            f"{row['max_logit_error'] / row['max_abs_logit']:>6.1%} {row['mean_logit_error']:>10.4f}  "
            f"{row['greedy_equal']}/{row['greedy_sequences']} {row['greedy_equal_prefixes']}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"topics": TOPICS, "tokens_per_passage": TOKENS_PER_PASSAGE, "rows": results}, f, indent=2
            )


if __name__ == "__main__":
    main()
