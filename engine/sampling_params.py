"""Per-request sampling parameters."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import numbers
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from sluice.engine.structured.constraint import Constraint

MAX_LOGPROBS = 20
MAX_N = 16  # samples of one prompt
MAX_LOGIT_BIAS = 100.0
# Each output token is searched for every stop string, in the frontend's one event loop that streams all
# requests: 100,000 stop strings cost ~30 ms a token there (the 2-core Zen 4 VM). TGI's default is 4.
MAX_STOP = 32
# Each output token is looked up in them, and min_tokens bans them every step: 1,000,000 ids cost ~12 ms a
# token and ~110 ms a step in the engine core. 1,024 is four times Llama 3's 256 special tokens.
MAX_STOP_TOKEN_IDS = 1024
# Temperatures in (0, MIN_TEMPERATURE) are raised to it, as vLLM does: logits divided by a float32
# temperature of 1e-45 are infinite, and the sampled tokens then are not the greedy ones they approach.
MIN_TEMPERATURE = 1e-2
# torch.Generator.manual_seed takes [-2**63, 2**64); sample i of an n-sample request draws from seed + i.
MIN_SEED, SEED_LIMIT = -(2**63), 2**64
# Float fields checked finite before any range check (inf passes `>= 0`, and NaN fails every range
# with a message that does not say why).
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_INT_FIELDS = ("top_k", "max_tokens", "min_tokens", "n")
_OPTIONAL_INT_FIELDS = ("seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    `temperature=0` is greedy. `top_k=0` and `top_p=1` and `min_p=0` disable those filters.
    `logprobs=None` returns none; `logprobs=N` returns the sampled token's logprob and the top N.
    `logit_bias` adds a bias to token ids' logits (a mapping or (token_id, bias) pairs, the last of an id's
    counting, as in a dict; kept sorted);
    `allowed_token_ids=None` allows every token, else only those. `constraint` forces the output to
    match a JSON schema, regex, grammar or choice (logprobs stay those of the raw model logits).
    `n` samples of the prompt share its full KV blocks (sample 0 computes the prompt, the others recompute
    its last partial block); with a `seed`, sample i
    draws from seed + i (`seed=-1` is no seed, as in vLLM). `prompt_logprobs=N` returns, once, the logprob
    of every prompt token after the first and the top N at each position (such a request takes no
    prefix-cache hit).
    `truncate_prompt_tokens=k` keeps the prompt's last k tokens, as vLLM's (-1: as many as the context
    holds beside max_tokens).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()  # or one string, a list, None
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string ends the text, included
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    constraint: Constraint | None = None
    n: int = 1
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        _normalize(self)
        _check_finite(self)
        checks = (
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0 or -1 disables it)"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]"),
            (all(self.stop), "stop", "must not contain empty strings"),
            (len(self.stop) <= MAX_STOP, "stop", f"at most {MAX_STOP} strings, got {len(self.stop)}"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0"),
            (
                len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
                "stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            (1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}]"),
            (
                self.seed is None or MIN_SEED <= self.seed <= SEED_LIMIT - self.n,
                "seed",
                f"must be in [{MIN_SEED}, {SEED_LIMIT - self.n}] (sample i of n draws from seed + i)",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            (
                self.truncate_prompt_tokens in (None, -1) or self.truncate_prompt_tokens >= 1,
                "truncate_prompt_tokens",
                "must be -1 (the model's context) or >= 1",
            ),
            (all(t >= 0 for t, _ in self.logit_bias), "logit_bias", "token ids must be >= 0"),
            (
                all(-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias),
                "logit_bias",
                f"biases must be in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            ),
            (
                self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
                "allowed_token_ids",
                "must not be empty (leave it unset to allow every token)",
            ),
            (
                all(t >= 0 for t in self.allowed_token_ids or ()),
                "allowed_token_ids",
                "must be >= 0",
            ),
        )
        for ok, name, message in checks:
            if not ok:
                raise ValueError(f"{name}: {message}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %g is below %g, raised to it", self.temperature, MIN_TEMPERATURE)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def held_back_by_min_tokens(self, eos_token_ids: Iterable[int], under_constraint: bool) -> set[int]:
        """The token ids banned until min_tokens outputs exist: stop_token_ids, and eos unless ignore_eos
        or the next token is `under_constraint` (its grammar mask lets eos through only where the
        constraint is complete, which ends the output there; banning it where nothing else matches would
        leave no token)."""
        held_back = set(self.stop_token_ids)
        if not self.ignore_eos and not under_constraint:
            held_back |= set(eos_token_ids)
        return held_back

    def constraint_applies(self, output_token_ids: Sequence[int]) -> bool:
        """Whether the constraint applies to the token after these outputs: from the first token, or after
        the first of its `after_token_id` (a thinking chat's think block is free). Scans the outputs."""
        constraint = self.constraint
        if constraint is None:
            return False
        return constraint.after_token_id is None or constraint.after_token_id in output_token_ids

    def with_constraint(self, constraint: Constraint) -> SamplingParams:
        """These params with `constraint` in place of theirs: a copy, not validated again (the frontend
        adds a chat's reasoning start to a constraint it already checked)."""
        params = copy.copy(self)
        object.__setattr__(params, "constraint", constraint)
        return params

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample `index` of an n-sample request: n=1, seed + index when seeded, and
        prompt logprobs for sample 0 only."""
        seed = None if self.seed is None else self.seed + index
        if seed == -1:  # a seed, not vLLM's "no seed": torch seeds -1 and 2**64 - 1 alike
            seed = SEED_LIMIT - 1
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return dataclasses.replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def _normalize(params: SamplingParams) -> None:
    """Fields to their types, or ValueError naming the field: numbers to float / int (an integer type such
    as numpy's too; a bool is no number here), sequences to tuples (callers pass lists; the params stay
    hashable and immutable), a lone stop string to one stop string, None to empty."""
    fields: dict[str, object] = {name: _float(name, getattr(params, name)) for name in _FLOAT_FIELDS}
    fields |= {name: _int(name, getattr(params, name)) for name in _INT_FIELDS}
    if fields["top_k"] == -1:  # vLLM's "disabled"
        fields["top_k"] = 0
    for name in _OPTIONAL_INT_FIELDS:
        if getattr(params, name) is not None:
            fields[name] = _int(name, getattr(params, name))
    if fields.get("seed") == -1:  # vLLM's "no seed": an unseeded request, not torch's seed -1
        fields["seed"] = None
    for name in _BOOL_FIELDS:
        if not isinstance(getattr(params, name), bool):
            raise ValueError(f"{name}: must be True or False, got {getattr(params, name)!r}")
    stop = (params.stop,) if isinstance(params.stop, str) else tuple(params.stop or ())
    if not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop: must be strings, got {list(stop)!r}")
    fields["stop"] = stop
    fields["stop_token_ids"] = _ints("stop_token_ids", params.stop_token_ids or ())
    bias = params.logit_bias.items() if isinstance(params.logit_bias, Mapping) else params.logit_bias or ()
    pairs = (
        (_int("logit_bias", t), _float("logit_bias", b)) for t, b in map(_pair, _items("logit_bias", bias))
    )
    fields["logit_bias"] = tuple(sorted(dict(pairs).items()))  # an id listed twice: its last bias, as dict()
    if params.constraint is not None and not isinstance(params.constraint, Constraint):
        raise ValueError(
            f"constraint: must be a Constraint (json_schema, regex, choice, ...), got {params.constraint!r}"
        )
    if params.allowed_token_ids is not None:
        fields["allowed_token_ids"] = _ints("allowed_token_ids", params.allowed_token_ids)
    for name, value in fields.items():
        object.__setattr__(params, name, value)


def _pair(item: object) -> tuple[object, object]:
    """A logit_bias entry: (token id, bias)."""
    if isinstance(item, str | bytes) or not isinstance(item, Iterable) or len(item := tuple(item)) != 2:
        raise ValueError(f"logit_bias: must map token ids to biases, got the entry {item!r}")
    return item


def _ints(name: str, values: object) -> tuple[int, ...]:
    return tuple(_int(name, value) for value in _items(name, values))


def _items(name: str, values: object) -> Iterable:
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise ValueError(f"{name}: must be a list, got {values!r}")
    return values


def _int(name: str, value: object) -> int:
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{name}: must be an integer, got {value!r}")


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    return float(value)


def _check_finite(params: SamplingParams) -> None:
    """Raises ValueError naming the first float field (or logit_bias entry) that is NaN or infinite."""
    for name in _FLOAT_FIELDS:
        if not math.isfinite(getattr(params, name)):
            raise ValueError(f"{name}: must be a finite number, got {getattr(params, name)}")
    for token_id, bias in params.logit_bias:
        if not math.isfinite(bias):
            raise ValueError(f"logit_bias: the bias of token {token_id} must be a finite number, got {bias}")
