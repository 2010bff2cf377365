"""Accuracy of `--quantization int4|int8` against float32 on the embedded SmolLM2-135M.

    python -m sluice.benchmarks.engine.quant_accuracy

Two measures, same engine code, float32 weights as the reference:
  * logit error on a fixed text: the text runs teacher-forced one token per step, as decode runs (so
    every step takes the quantized path, lm_head included); max |logit - fp32 logit| over all positions,
    also relative to max |fp32 logit|, and how often the top-1 token agrees;
  * greedy agreement: a few chat prompts decode 64 tokens each; positions equal to float32's output before
    the first divergence, and whole sequences equal.
"""

from __future__ import annotations

import argparse

import torch

from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler.scheduler_output import ScheduledRequest, SchedulerOutput
from sluice.engine.worker.input_batch import build_model_inputs

TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under water. "
    "Farmers moved their animals to the ridge, where the old church stood, and the children watched "
    "from the bell tower as boats drifted past the tops of the fences. By noon the rain had stopped, "
    "but the water kept coming from the hills, carrying branches, barrels and, once, a whole wooden "
    "shed with a surprised cat on its roof. The mayor called a meeting in the school hall to decide "
    "whether the bridge could still be trusted."
)
PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three tips for learning a new language.",
    "What is the capital of France, and why is it famous?",
)


@torch.inference_mode()
def teacher_forced_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] float32, computed in steps of one token, as decode steps run."""
    runner = llm.engine.model_runner
    num_blocks = -(-len(token_ids) // runner.block_size)
    blocks = tuple(range(num_blocks))
    rows = []
    for start in range(len(token_ids)):
        chunk = (token_ids[start],)
        out = SchedulerOutput((ScheduledRequest("text", chunk, start, blocks, False),), len(chunk))
        inputs = build_model_inputs(out, runner.block_size, runner.device)
        hidden = runner.forward(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.metadata)
        rows.append(runner.model.compute_logits(hidden))
    return torch.cat(rows)


def greedy(llm: LLM, max_tokens: int) -> list[list[int]]:
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [c.token_ids for c in llm.chat(conversations, params)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.benchmarks.engine.quant_accuracy", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--methods", nargs="+", default=["int4", "int8"])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    reference = LLM(dtype="float32", enable_prefix_caching=False)
    token_ids = reference.tokenizer.encode(TEXT)
    ref_logits = teacher_forced_logits(reference, token_ids)
    ref_greedy = greedy(reference, args.max_tokens)
    scale = ref_logits.abs().max().item()
    print(f"text: {len(token_ids)} tokens; greedy: {len(PROMPTS)} chat prompts x {args.max_tokens} tokens")
    del reference
    for method in args.methods:
        llm = LLM(dtype="float32", quantization=method, enable_prefix_caching=False)
        logits = teacher_forced_logits(llm, token_ids)
        error = (logits - ref_logits).abs().max().item()
        top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
        outputs = greedy(llm, args.max_tokens)
        prefixes = [common_prefix(a, b) for a, b in zip(outputs, ref_greedy, strict=True)]
        equal = sum(a == b for a, b in zip(outputs, ref_greedy, strict=True))
        print(
            f"{method}: max |logit error| {error:.3f} ({error / scale:.1%} of max |logit| {scale:.1f}); "
            f"top-1 agreement {top1:.1%}; greedy: {equal}/{len(PROMPTS)} sequences equal, equal prefixes "
            f"{prefixes} of {args.max_tokens}",
            flush=True,
        )
        del llm


if __name__ == "__main__":
    main()
