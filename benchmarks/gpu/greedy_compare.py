"""Greedy outputs of two servers on the same prompts, compared token by token.

Two correct engines that round differently (bf16 kernels of other shapes: a speculative verify step
against a decode step, a tensor-parallel all-reduce against one GEMM) can still pick different tokens
where the model's top two are within rounding of each other; after that the sequences rightly part. So
each sample is compared up to its first difference, and a difference counts as a near tie, not a
mismatch, only when each side's token is among the other's top logprobs and both sides put the two
within `near_tie_nats` of each other (the approach of vLLM's `check_logprobs_close`). Anything else is a
mismatch: the check fails.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

# A sample as recorded: {"tokens": [id, ...], "top": [[[id, logprob], ...] per position], ...}
Sample = dict[str, Any]


def greedy_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of 44 token ids: a 12-token motif three times, then 8 more. The repeats give
    prompt-lookup (ngram) speculation something to propose."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        motif = [rng.randrange(3, vocab_size) for _ in range(12)]
        prompts.append(motif * 3 + [rng.randrange(3, vocab_size) for _ in range(8)])
    return prompts


@dataclass(frozen=True)
class Verdict:
    """How one sample compares: "equal", "near tie" (first difference at `position`, where the
    reference put `gap` nats between the two tokens) or "mismatch"."""

    kind: str
    position: int | None = None
    gap: float | None = None
    detail: str = ""


def _top(sample: Sample, position: int) -> dict[int, float]:
    tops = sample.get("top") or []
    return {int(token): float(logprob) for token, logprob in tops[position]} if position < len(tops) else {}


def compare_sample(reference: Sample, candidate: Sample, near_tie_nats: float) -> Verdict:
    ref, cand = reference["tokens"], candidate["tokens"]
    position = next((i for i, (a, b) in enumerate(zip(ref, cand, strict=False)) if a != b), None)
    if position is None:
        if len(ref) == len(cand):
            return Verdict("equal")
        return Verdict("mismatch", min(len(ref), len(cand)), None, f"{len(ref)} vs {len(cand)} tokens")
    ref_token, cand_token = ref[position], cand[position]
    ref_top, cand_top = _top(reference, position), _top(candidate, position)
    detail = f"token {ref_token} vs {cand_token} at position {position}"
    if cand_token not in ref_top or ref_token not in cand_top:
        return Verdict("mismatch", position, None, detail + ": not in each other's top logprobs")
    gap = ref_top[ref_token] - ref_top[cand_token]
    other_gap = cand_top[cand_token] - cand_top[ref_token]
    if max(gap, other_gap) > near_tie_nats:
        return Verdict("mismatch", position, gap, detail + f": {max(gap, other_gap):.4f} nats apart")
    return Verdict("near tie", position, gap, detail + f": {gap:.4f} nats apart")


def compare_greedy(reference: list[Sample], candidate: list[Sample], near_tie_nats: float) -> list[Verdict]:
    """One verdict per sample; the lists must pair up."""
    if len(reference) != len(candidate):
        raise ValueError(f"candidate: {len(candidate)} samples, the reference has {len(reference)}")
    return [compare_sample(r, c, near_tie_nats) for r, c in zip(reference, candidate, strict=True)]


def summarize(verdicts: list[Verdict]) -> dict[str, Any]:
    """Counts of each kind and the details of every sample that was not equal."""
    counts = {kind: sum(v.kind == kind for v in verdicts) for kind in ("equal", "near tie", "mismatch")}
    details = [f"sample {i}: {v.kind}, {v.detail}" for i, v in enumerate(verdicts) if v.kind != "equal"]
    return {**counts, "details": details}


def comparison_line(comparison: dict[str, Any], extra: str = "") -> str:
    """`summarize`'s counts as a sentence (then `extra`), and a line per sample that differed."""
    counts = (
        f"{comparison['equal']} equal, {comparison['near tie']} parting at a near tie, "
        f"{comparison['mismatch']} mismatched{extra}."
    )
    return counts + "".join(f"\n- {line}" for line in comparison["details"])


def agreement(reference: list[Sample], candidate: list[Sample]) -> dict[str, int]:
    """How far `candidate` follows `reference` where the two need not be equal (another quantization):
    samples equal, and tokens before each sample's first difference (after it the sequences part)."""
    if len(reference) != len(candidate):
        raise ValueError(f"candidate: {len(candidate)} samples, the reference has {len(reference)}")
    prefixes = [
        next((i for i, (a, b) in enumerate(zip(r["tokens"], c["tokens"], strict=False)) if a != b),
             min(len(r["tokens"]), len(c["tokens"])))
        for r, c in zip(reference, candidate, strict=True)
    ]  # fmt: skip
    return {
        "samples": len(reference),
        "equal": sum(r["tokens"] == c["tokens"] for r, c in zip(reference, candidate, strict=True)),
        "tokens_before_first_difference": sum(prefixes),
        "tokens": sum(len(r["tokens"]) for r in reference),
    }
