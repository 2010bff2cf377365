"""Batched token sampling: logits processors, temperature, top-k / top-p / min-p, seeded generators, logprobs.

Order per row (vLLM's and transformers' for the processors; transformers' warper order, where vLLM V1
applies min_p before top_k / top_p):
  raw logits --(logprobs are taken here: log_softmax of the raw model logits)
  -> the logits processors, in list order (sluice.engine.sample.logits_processors):
     min_tokens mask (eos and stop_token_ids get -inf until min_tokens outputs exist)
     -> logit_bias
     -> repetition penalty on prompt + output tokens (positive logits divided, negative multiplied)
     -> frequency / presence penalties on output tokens (OpenAI: logit -= f * count + p * [count > 0])
     -> allowed_token_ids -> grammar mask (when the engine core adds one)
  -> greedy rows: argmax;  random rows: / temperature -> top_k -> top_p -> min_p -> draw
A draw inverts the row's cumulative distribution at one uniform number; each seeded request draws its
numbers from its own generator, so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from sluice.engine.outputs import OutputLogprobs
from sluice.engine.sample.device_tensor import device_tensor
from sluice.engine.sample.logits_processors import LogitsProcessor, default_processors
from sluice.engine.sample.top_logprobs import by_value_then_id, top_k_ties_by_id
from sluice.engine.sampling_params import SamplingParams
from sluice.kernels.cpu_argmax import EXTENSION as ARGMAX_EXTENSION
from sluice.kernels.cpu_argmax import cpu_argmax_prechecked
from sluice.kernels.cpu_extension import cpu_extension_available

# The most likely tokens a top_p-only row's nucleus is looked for among on the host before sorting the
# row whole (docs/BENCHMARKS.md).
NUCLEUS_CANDIDATES = 1024
# float32's largest value. A temperature above it (1e39 is a finite Python float) is inf on the device, and a
# masked logit over it NaN; a logit at it (where an extreme repetition penalty put it) over a temperature
# below 1 is inf, and a row with two infinities softmaxes to NaN. Either row drew the vocabulary's last id,
# allowed or not.
FLOAT32_MAX = torch.finfo(torch.float32).max


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for x [rows, vocab]: the first maximum of each row, NaN counting as the maximum.
    Float32 on CPU: the C++ kernel (one vectorised pass, rows in parallel), where it is built."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and cpu_extension_available(ARGMAX_EXTENSION):
        return cpu_argmax_prechecked(x)
    return x.argmax(dim=-1)


@dataclass(frozen=True)
class SamplingRow:
    """One row of the logits batch: the request it samples for and the tokens it has seen.

    `grammar` is the compiled grammar of a request with a constraint (opaque here; the grammar mask
    processor reads it). `token_in_flight` (async scheduling): the token the step still running samples
    for the request, not yet in `output_token_ids`, as a [1] int64 tensor on the logits' device; the
    processors that count the outputs (penalties, min_tokens) count it too, without waiting for it.
    `num_drafts` (a speculative verify row): how many of `output_token_ids`, at their end, are drafts this
    row follows, not accepted yet. The processors read them as outputs of this row only: the penalties
    count them on the step's copy of their counts; a draft the grammar refuses leaves the row unmasked
    (the rejection sampler never uses it: the row before masks that draft out, so it is rejected there
    or earlier).
    """

    request_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    grammar: object | None = None
    token_in_flight: torch.Tensor | None = None
    num_drafts: int = 0

    @property
    def num_output_tokens(self) -> int:
        """Output tokens before the one this row samples: those on the host and the one in flight."""
        return len(self.output_token_ids) + (self.token_in_flight is not None)


def apply_processors(
    processors: Sequence[LogitsProcessor], logits: torch.Tensor, rows: Sequence[SamplingRow]
) -> torch.Tensor:
    """logits [num_rows, vocab] with `processors` applied in order: a float32 copy, or `logits` itself
    when none concerns any row."""
    active = [p for p in processors if any(p.applies_to(row) for row in rows)]
    if not active:
        return logits
    processed = logits.float().clone()
    for processor in active:
        processor.apply(processed, rows)
    return processed


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: OutputLogprobs | None  # one entry, this token's, when its request asks for logprobs


class Sampler:
    """Samples one token per logits row. Holds the generators of seeded requests and the processors'
    per-request state until `free`. `processors` default to `default_processors()`."""

    def __init__(self, seed: int | None = None, processors: Sequence[LogitsProcessor] | None = None) -> None:
        self._seed = seed
        self._generator: torch.Generator | None = None
        self._request_generators: dict[str, torch.Generator] = {}
        self.processors = list(default_processors() if processors is None else processors)

    def free(self, request_ids: Iterable[str]) -> None:
        """Drop the per-request generators and processor state of finished requests."""
        request_ids = list(request_ids)
        for request_id in request_ids:
            self._request_generators.pop(request_id, None)
        for processor in self.processors:
            processor.free(request_ids)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        """logits: [num_rows, vocab] float32, row i belongs to rows[i]. Does not modify `logits`."""
        logits = logits.float()
        return self.attach_logprobs(logits, rows, self.sample_no_sync(logits, rows))

    def sample_no_sync(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """`sample`'s token ids [num_rows] int64, left on the logits' device: on CUDA the work is queued
        and nothing waits for it (greedy rows, random rows' filters and draws, the default processors
        and the grammar mask)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(rows)} rows")
        logits = logits.float()
        processed = self.apply_processors(logits, rows)
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not random:  # no row selection: indexing would copy [rows, vocab]
            return argmax_rows(processed)
        device = logits.device
        token_ids = torch.empty(len(rows), dtype=torch.long, device=device)
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if greedy:
            index = device_tensor(greedy, torch.long, device)
            token_ids[index] = argmax_rows(processed[index])
        sub_rows = [rows[i] for i in random]
        index = device_tensor(random, torch.long, device)
        probs = torch.softmax(apply_filters(processed[index], sub_rows), dim=-1)
        token_ids[index] = self.draw(probs, sub_rows)
        return token_ids

    def apply_processors(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """logits [num_rows, vocab] float32 with every logits processor applied: a copy, or `logits`
        itself when no processor concerns any row (the caller must not modify the result in place).

        Copying is what a plain batch would pay for nothing: at 256 x 49152 float32 the copy is 50 MB,
        mapped and faulted in afresh each step (over glibc's mmap threshold; docs/BENCHMARKS.md).
        """
        return apply_processors(self.processors, logits, rows)

    def fractions(self, rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
        """[len(rows)] numbers from U[0, 1) on `device`, row i's from its request's generator when it is
        seeded (a request's rows in order), the others' from the shared one."""
        generators = [self._generator_of(row, device) for row in rows]
        return uniform_fractions(generators, device)

    def draw(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """probs: [m, vocab], row i for rows[i]; returns [m] token ids, each drawn from its row
        (`draw_at`) at one uniform number, from the request's own generator when it is seeded."""
        return draw_at(probs, self.fractions(rows, probs.device))

    def _generator_of(self, row: SamplingRow, device: torch.device) -> torch.Generator:
        return self._shared(device) if row.params.seed is None else self._for_request(row, device)

    def _shared(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            if self._seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(self._seed)
        return self._generator

    def _for_request(self, row: SamplingRow, device: torch.device) -> torch.Generator:
        generator = self._request_generators.get(row.request_id)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(row.params.seed)
            self._request_generators[row.request_id] = generator
        return generator

    def attach_logprobs(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
    ) -> list[SampledToken]:
        pending = logprobs_no_sync(logits, rows, token_ids)
        ids = token_ids.tolist()
        if pending is None:
            return [SampledToken(token_id, None) for token_id in ids]
        return pending.sampled_tokens(ids, pending.tensors)


@dataclass(frozen=True)
class DeviceLogprobs:
    """The logprobs a batch asked for, still on the logits' device (`tensors`: the sampled tokens'
    logprobs [w], the top values [w, n] and ids [w, n] of the w rows that asked, n the most any asked).
    `sampled_tokens` reads them once they are on the host (or from the device, waiting for it)."""

    wanted: tuple[int, ...]  # rows that asked for logprobs
    num_top: tuple[int, ...]  # how many top tokens each of them asked for
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    def sampled_tokens(self, token_ids: Sequence[int], tensors: Sequence[torch.Tensor]) -> list[SampledToken]:
        """One `SampledToken` per row: token_ids[i] with its logprobs where row i asked for them;
        `tensors`: `self.tensors` or host copies of them. Columns from `tolist()`, no object per value."""
        sampled, top_values, top_ids = (t.tolist() for t in tensors)
        by_row: dict[int, OutputLogprobs] = {}
        for j, (i, n) in enumerate(zip(self.wanted, self.num_top, strict=True)):
            by_row[i] = OutputLogprobs([token_ids[i]], [sampled[j]], n, top_ids[j][:n], top_values[j][:n])
        return [SampledToken(token_id, by_row.get(i)) for i, token_id in enumerate(token_ids)]


def logprobs_no_sync(
    logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
) -> DeviceLogprobs | None:
    """The logprobs of the rows that ask for them (log_softmax of the raw logits; the top ones in
    decreasing logprob, ties in increasing token id), queued on the device without waiting for it; None
    when no row asks."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return None
    index = device_tensor(wanted, torch.long, logits.device)
    logprobs = torch.log_softmax(logits[index], dim=-1)
    sampled = logprobs.gather(1, token_ids[index].unsqueeze(1)).squeeze(1)
    num_top = tuple(rows[i].params.logprobs for i in wanted)
    # Ties by token id: a row's first n of the batch's largest k are its own top n.
    top_values, top_ids = top_k_ties_by_id(logprobs, max(num_top))
    return DeviceLogprobs(tuple(wanted), num_top, (sampled, top_values, top_ids))


def draw_at(probs: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """probs: [m, vocab] (each row's total need not be 1), fractions: [m] in [0, 1); returns [m] token ids:
    each row's first token whose cumulative sum passes fractions[i] of the row's total, i.e. a draw from
    the row when the fraction is uniform. One number a row: the exponential race this replaced drew one
    a token (64 x 49,152 exponentials took ~65 ms on the host)."""
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1:].contiguous()
    token_ids = torch.searchsorted(cumulative, fractions.unsqueeze(1) * total, right=True)
    # A fraction just below 1 can round the product up to the total: then the last token with mass.
    last = torch.searchsorted(cumulative, total)
    # A row whose total is NaN (NaN logits from the model) finds no token: the last id, never one past
    # the vocabulary, which the next step's embedding would index out of range.
    return torch.where(token_ids < probs.shape[1], token_ids, last).clamp_(max=probs.shape[1] - 1).squeeze(1)


def uniform_fractions(generators: Sequence[torch.Generator], device: torch.device) -> torch.Tensor:
    """[len(generators)] numbers from U[0, 1), the i-th from generators[i]; rows that share a generator
    (the unseeded ones) take theirs from it in one call, in row order."""
    fractions = torch.empty(len(generators), device=device)
    rows_of: dict[int, list[int]] = {}
    for i, generator in enumerate(generators):
        rows_of.setdefault(id(generator), []).append(i)
    for rows in rows_of.values():
        generator = generators[rows[0]]
        if len(rows) == len(generators):
            fractions.uniform_(generator=generator)
        else:
            index = device_tensor(rows, torch.long, device)
            fractions[index] = torch.rand(len(rows), generator=generator, device=device)
    return fractions


def apply_filters(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, then top_k, top_p, min_p; filtered-out entries become -inf. Returns a new tensor.
    top_k keeps the tokens tied with the k-th most likely too, as transformers and vLLM do."""
    device = logits.device
    vocab = logits.shape[1]
    temperatures = [min(r.params.temperature, FLOAT32_MAX) for r in rows]
    temperature = device_tensor(temperatures, torch.float32, device).unsqueeze(1)
    logits = (logits / temperature).clamp_(max=FLOAT32_MAX)  # -inf (masked) stays -inf
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    if any(r.params.min_p > 0 for r in rows):  # decided on the host: a device check would wait for it
        min_p = device_tensor([r.params.min_p for r in rows], torch.float32, device).unsqueeze(1)
        probs = torch.softmax(logits, dim=-1)
        too_unlikely = probs < min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(too_unlikely, float("-inf"))
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """logits [m, vocab] with each row's top_k (vocab: off) and top_p (1.0: off) cuts, -inf where cut.

    On a GPU every row is sorted whole. On the host, where sorting 64 rows of 49,152 took ~120 ms, the
    cuts are made among each row's most likely tokens (`topk`): its top_k, or NUCLEUS_CANDIDATES where it
    has only top_p; a row whose nucleus reaches past those (a flat distribution) is sorted whole.
    The nucleus takes tied tokens in increasing id on every path, so which of a tie it keeps does not
    depend on how many candidates the batch's other rows ask for (a seed reproduces whatever the batch)."""
    device, vocab = logits.device, logits.shape[1]
    top_k_t = device_tensor(top_k, torch.long, device)
    top_p_t = device_tensor(top_p, torch.float32, device)
    if device.type != "cpu":
        return _cut_sorted(logits, top_k_t, top_p_t)
    # One candidate past the most any row keeps: a tie at a row's k-th place shows among them.
    candidates = min(max(k if k < vocab else min(NUCLEUS_CANDIDATES, vocab) for k in top_k) + 1, vocab)
    values, order = _candidates(logits, candidates)
    last = values[:, -1].clone()  # a value topk may have kept only some of the tokens of
    rank = torch.arange(candidates).unsqueeze(0)
    has_top_k = [k < vocab for k in top_k]
    by_top_k = torch.tensor(has_top_k).unsqueeze(1)
    kth = values.gather(1, (top_k_t.clamp(max=candidates) - 1).unsqueeze(1))
    values = values.masked_fill(by_top_k & (values < kth), float("-inf"))
    # A tie at the k-th place that runs to the last candidate may run past it: such rows are sorted whole
    # (not a row with fewer than k finite logits, a constraint's: its k-th is -inf, and so is all past it).
    kth_finite = torch.isfinite(kth.squeeze(1))
    tie_past = by_top_k.squeeze(1) & kth_finite & (values[:, -1] >= kth.squeeze(1)) & (candidates < vocab)
    # Each row's log normaliser: over its top_k tokens (all among the candidates), else over the vocabulary.
    whole_rows = 0.0 if all(has_top_k) else torch.logsumexp(logits, dim=-1, keepdim=True)
    log_total = torch.where(by_top_k, _top_k_log_total(values), whole_rows)
    probs = torch.exp(values - log_total)
    values = values.masked_fill(_past_nucleus(probs, top_p_t, rank), float("-inf"))
    cut = torch.full_like(logits, float("-inf")).scatter_(1, order, values)
    # Rows with neither cut keep every token; a top_p-only row whose candidates hold less than top_p of
    # its mass has tokens past them in its nucleus.
    uncut = [i for i, (k, p) in enumerate(zip(top_k, top_p, strict=True)) if k >= vocab and p >= 1.0]
    if uncut:
        cut[uncut] = logits[uncut]
    top_p_only = ~by_top_k.squeeze(1) & (top_p_t < 1.0)
    # A top_p-only nucleus that reaches the last candidate's value may need the lower ids of its tie.
    tie_at_last = (values == last.unsqueeze(1)).any(dim=-1) & torch.isfinite(last) & (candidates < vocab)
    wider = ((((probs.sum(dim=-1) < top_p_t) | tie_at_last) & top_p_only) | tie_past).nonzero().squeeze(1)
    if wider.numel():
        cut[wider] = _cut_sorted(logits[wider], top_k_t[wider], top_p_t[wider])
    return cut


def _candidates(logits: torch.Tensor, candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `candidates` largest logits and their ids, in decreasing value, tied values in
    increasing id (`topk` orders a tie as it happens to: another way for another count). Only rows with
    a finite tie are reordered."""
    values, order = logits.topk(candidates, dim=-1)
    tied = ((values[:, 1:] == values[:, :-1]) & torch.isfinite(values[:, 1:])).any(dim=-1)
    tied = tied.nonzero().squeeze(1)
    if tied.numel():
        values[tied], order[tied] = by_value_then_id(values[tied], order[tied])
    return values, order


def _top_k_log_total(values: torch.Tensor) -> torch.Tensor:
    """logsumexp of each row [m, n] (its top_k tokens, -inf past them), keepdim. On the host in float64,
    rounded back: the float32 sum's last bit depends on how many -inf columns the row has, as many as the
    batch's largest top_k asks for, and a nucleus ending within it of top_p ended a token apart beside
    other requests (5 of 400 rows at exact boundaries). On a GPU every row is sorted whole (n: the
    vocabulary), whatever the batch."""
    if values.device.type != "cpu":
        return torch.logsumexp(values, dim=-1, keepdim=True)
    return torch.logsumexp(values.double(), dim=-1, keepdim=True).to(values.dtype)


def _cut_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`_top_k_top_p` over each row's whole vocabulary, sorted. top_k, top_p: [m] on the logits' device."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # ties in increasing id
    rank = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    # top_k by value, as transformers and vLLM cut: tokens tied with the k-th stay (by rank, which of
    # them stayed was the sort's choice, another on the host's path than on a GPU's).
    kth = sorted_logits.gather(1, (top_k.clamp(max=logits.shape[1]) - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # As the candidates' path computes them (not softmax). On the host, the normaliser of a row without
    # top_k over its logits in id order as there (summed sorted, its last bit can differ): a row's nucleus
    # ends alike on either path, and which one a row takes depends on the batch. A GPU has one path.
    log_total = _top_k_log_total(sorted_logits)
    if logits.device.type == "cpu":
        by_top_k = (top_k < logits.shape[1]).unsqueeze(1)
        log_total = torch.where(by_top_k, log_total, torch.logsumexp(logits, dim=-1, keepdim=True))
    probs = torch.exp(sorted_logits - log_total)
    sorted_logits = sorted_logits.masked_fill(_past_nucleus(probs, top_p, rank), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _past_nucleus(probs: torch.Tensor, top_p: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """probs [m, n] in decreasing order (a prefix of each row's): True past each row's nucleus.
    transformers removes a token when the ascending cumulative mass up to it is <= 1 - top_p, i.e. when the
    tokens ranked above it already hold >= top_p of the mass. The top token always stays."""
    mass_before = probs.cumsum(dim=-1) - probs
    return (mass_before >= top_p.unsqueeze(1)) & (rank > 0)
