"""Structured output with speculative decoding: a constrained request verifies drafts.

Each verify row of a constrained request is masked by its grammar after the drafts the row follows; a
draft the grammar refuses leaves the rows after it unmasked (they are never used: the row before masks
that draft out, so the verification stops there), and the next step rolls back the drafts the
verification rejected, also when as many tokens were accepted as the matcher took; drafts from the first
one the grammar refuses are dropped before the step (vLLM's validate_tokens), and the tokens the grammar
forces after those kept are drafted (jump-forward, as drafts: q a point mass). Unit tests on a
six-token vocabulary; then the embedded SmolLM2-135M-Instruct (real weights and tokenizer): greedy
constrained outputs are identical with ngram speculation and without (synchronous and async scheduling),
with drafts verified and accepted, and sampled ones stay valid."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import xgrammar as xgr

from sluice.engine.config import SpeculativeConfig
from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.default_model import default_model_path
from sluice.engine.request import Request
from sluice.engine.sample.grammar_mask import GrammarMask, GrammarViolationError
from sluice.engine.sample.sampler import SamplingRow
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode.proposer import Proposal
from sluice.engine.spec_decode.speculator import Speculator
from sluice.engine.structured.constraint import Constraint

A, B, C, X, Y, EOS = range(6)
VOCAB = ["a", "b", "c", "x", "y", "</s>"]
GRAMMAR = 'root ::= "a" "b" ("a" "x" | "c" "y")'
EVERY_TOKEN = set(range(len(VOCAB)))


@pytest.fixture(scope="module")
def grammar() -> object:
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS]))
    return compiler.compile_grammar(GRAMMAR)


def _row(grammar: object, outputs: list[int], num_drafts: int = 0) -> SamplingRow:
    return SamplingRow(
        "r", SamplingParams(temperature=0.0), [A], outputs, grammar=grammar, num_drafts=num_drafts
    )


def _allowed(mask: GrammarMask, rows: list[SamplingRow]) -> list[set[int]]:
    """The tokens each row keeps once the mask is applied."""
    logits = torch.zeros(len(rows), len(VOCAB))
    mask.apply(logits, rows)
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]


def _verify_rows(grammar: object, outputs: list[int], drafts: list[int]) -> list[SamplingRow]:
    """A verify step's rows for a request (as `RejectionSampler.verify` expands them)."""
    return [_row(grammar, [*outputs, *drafts[:j]], j) for j in range(len(drafts) + 1)]


def test_each_verify_row_is_masked_as_the_grammar_stands_after_its_drafts(grammar) -> None:
    assert _allowed(GrammarMask(), _verify_rows(grammar, [A], [B, A])) == [{B}, {A, C}, {X}]


def test_rows_after_a_draft_the_grammar_refuses_go_unmasked(grammar) -> None:
    rows = _verify_rows(grammar, [A], [B, B, X])
    assert _allowed(GrammarMask(), rows) == [{B}, {A, C}, EVERY_TOKEN, EVERY_TOKEN]


def test_the_next_step_rolls_back_the_drafts_the_verification_rejected(grammar) -> None:
    mask = GrammarMask()
    _allowed(mask, _verify_rows(grammar, [A], [B, A]))  # the matcher took a, b, a
    # b accepted, a rejected, c sampled: as many tokens as the matcher took, the last one another.
    assert _allowed(mask, _verify_rows(grammar, [A, B, C], [Y])) == [{Y}, {EOS}]
    # The next step after that: y rejected again (x is not even possible here): a plain row.
    assert _allowed(mask, [_row(grammar, [A, B, C])]) == [{Y}]


def test_rows_past_an_eos_draft_go_unmasked_without_feeding_the_complete_matcher(grammar, capfd) -> None:
    rows = _verify_rows(grammar, [A], [B, A, X, EOS, A])
    assert _allowed(GrammarMask(), rows) == [{B}, {A, C}, {X}, {EOS}, EVERY_TOKEN, EVERY_TOKEN]
    assert "terminated" not in capfd.readouterr().err  # xgrammar warns of each token a complete one is fed


def test_a_token_the_request_holds_must_still_match_its_grammar(grammar) -> None:
    assert _allowed(GrammarMask(), [_row(grammar, [A, A], num_drafts=1)]) == [EVERY_TOKEN]
    with pytest.raises(GrammarViolationError):
        _allowed(GrammarMask(), [_row(grammar, [A, A])])
    # Proposing drafts after such outputs (after the step that sampled them) raises nothing: no drafts,
    # and the next step's mask fails that request alone.
    mask = GrammarMask()
    assert mask.constrained_drafts("r", grammar, [A, A], (B,), 3) == (0, ())
    with pytest.raises(GrammarViolationError):
        _allowed(mask, [_row(grammar, [A, A])])


def test_drafts_are_kept_up_to_the_first_one_the_grammar_refuses(grammar) -> None:
    mask = GrammarMask()
    assert mask.constrained_drafts("r", grammar, [A], (B, B, X), 5) == (1, ())
    assert mask.constrained_drafts("r", grammar, [A], (B, A, X, EOS, A), 5) == (4, ())  # none after eos
    assert mask.constrained_drafts("r", grammar, [A], (B, A, X, EOS), 2) == (2, ())  # k at most
    # The matcher is left as the outputs leave it: the rows of the step that verifies them.
    assert _allowed(mask, _verify_rows(grammar, [A], [B, A])) == [{B}, {A, C}, {X}]


def test_drafts_are_kept_after_the_tokens_the_verification_kept(grammar) -> None:
    mask = GrammarMask()
    _allowed(mask, _verify_rows(grammar, [A], [B, A]))  # the matcher took a, b, a
    # b accepted, a rejected, c sampled: y is next, then eos and nothing.
    assert mask.constrained_drafts("r", grammar, [A, B, C], (Y, EOS, A), 5) == (2, ())
    assert mask.constrained_drafts("r", grammar, [A, B, C], (X, Y), 5) == (0, (Y,))


def test_what_the_grammar_forces_is_drafted_after_the_drafts_it_accepts(grammar) -> None:
    mask = GrammarMask()
    assert mask.constrained_drafts("r", grammar, [], (), 5) == (0, (A, B))  # then a choice: a or c
    assert mask.constrained_drafts("r", grammar, [], (), 1) == (0, (A,))
    assert mask.constrained_drafts("r", grammar, [], (A, C), 5) == (1, (B,))
    assert mask.constrained_drafts("r", grammar, [A, B], (C,), 5) == (1, (Y,))  # no stop token drafted
    assert mask.constrained_drafts("r", grammar, [A, B, A, X], (), 5) == (0, ())
    assert _allowed(mask, [_row(grammar, [A, B])]) == [{A, C}]


class _Offering:
    """A proposer that offers the same proposals every time."""

    def __init__(self, proposals: dict[str, Proposal]) -> None:
        self.proposals = proposals

    def propose(self, requests: list[Request]) -> dict[str, Proposal]:
        return dict(self.proposals)

    def free(self, request_ids: object) -> None:
        pass


def _propose(
    grammar: object, outputs: list[int], offering: dict[str, Proposal]
) -> tuple[list[int], Speculator]:
    """The drafts a constrained request with these outputs gets, and the speculator that holds them."""
    params = SamplingParams(temperature=1.0, constraint=Constraint(grammar=GRAMMAR))
    request = Request("r", [A], params, frozenset({EOS}), 0.0, output_token_ids=outputs, grammar=grammar)
    mask = GrammarMask()
    speculator = Speculator(_Offering(offering), constrain=mask.constrained_drafts, num_speculative_tokens=3)
    speculator.propose([request], lambda _: request)
    row = _row(grammar, outputs)
    assert _allowed(mask, [row]) == _allowed(GrammarMask(), [row])  # the matcher left as it was
    return request.spec_token_ids, speculator


def test_a_request_the_proposer_offers_nothing_drafts_what_its_grammar_forces(grammar) -> None:
    drafts, speculator = _propose(grammar, [A], {})
    assert drafts == [B]  # then a or c
    assert speculator.proposal("r", (B,)) == Proposal((B,))


def test_a_forced_draft_after_a_draft_models_drafts_has_a_point_mass_for_its_q(grammar) -> None:
    q = torch.softmax(torch.randn(2, len(VOCAB)), dim=-1)
    drafts, speculator = _propose(grammar, [A, B], {"r": Proposal((C, X), q)})
    assert drafts == [C, Y]  # x refused, y forced
    probs = speculator.proposal("r", (C, Y)).probs
    assert torch.equal(probs, torch.stack([q[0], torch.eye(len(VOCAB))[Y]]))


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
    },
    "required": ["name", "city", "age"],
    "additionalProperties": False,
}
TEXTS = [
    "Extract as JSON. Text: Alice Johnson lives in Springfield and is 34 years old. Alice Johnson likes tea.",
    "Extract as JSON. Text: Bob Smith, aged 51, moved to Rivertown last year. Bob Smith is a baker.",
]
CONSTRAINTS = [
    Constraint(json_schema=json.dumps(PERSON)),
    Constraint(regex=r"(Alice|Bob) [A-Z][a-z]+ lives in [A-Z][a-z]+"),
    Constraint(choice=("Alice Johnson", "Bob Smith", "nobody")),
]
NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=4)


def _conversations() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": text}] for text in TEXTS]


def _greedy_runs(llm: LLM) -> list[list[int]]:
    tokens = []
    for constraint in CONSTRAINTS:
        params = SamplingParams(temperature=0.0, max_tokens=60, constraint=constraint)
        tokens += [c.token_ids for c in llm.chat(_conversations(), params)]
    return tokens


@pytest.fixture(scope="module")
def plain_tokens() -> list[list[int]]:
    return _greedy_runs(LLM())


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_constrained_greedy_tokens_are_identical_with_ngram_speculation(
    plain_tokens, async_scheduling
) -> None:
    llm = LLM(speculative=NGRAM, async_scheduling=async_scheduling)
    assert _greedy_runs(llm) == plain_tokens
    stats = llm.engine.stats()
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert stats.num_kv_blocks_used == 0


def test_drafts_the_grammar_refuses_are_dropped_before_the_step(plain_tokens, monkeypatch) -> None:
    """No verify row follows a draft the grammar refuses (the mask's sync would say None there)."""
    refused = []
    sync_row = GrammarMask._sync_row

    def recording(self, row):
        state = sync_row(self, row)
        refused.extend([row.output_token_ids] if state is None else [])
        return state

    monkeypatch.setattr(GrammarMask, "_sync_row", recording)
    llm = LLM(speculative=NGRAM)
    assert _greedy_runs(llm) == plain_tokens
    assert refused == []
    assert llm.engine.stats().num_draft_tokens > 0


def test_constrained_greedy_tokens_are_identical_with_a_draft_model(plain_tokens) -> None:
    """The draft model (SmolLM2 itself) proposes without the grammar; the drafts it refuses are dropped
    before the step, what the grammar forces after the others drafted."""
    draft = SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=default_model_path())
    llm = LLM(speculative=draft)
    assert _greedy_runs(llm) == plain_tokens
    stats = llm.engine.stats()
    assert 0 < stats.num_accepted_draft_tokens <= stats.num_draft_tokens


def test_text_the_grammar_forces_is_drafted_where_the_lookup_finds_nothing() -> None:
    """The one choice (its first token sampled at the prompt's step, the rest forced) repeats no 4 tokens
    of the prompt or of itself, so a lookup of 4-grams has nothing to offer: every draft verified is one
    the grammar forced. Greedy tokens are those without speculation."""
    choice = "Zorvex Quimble of Plarnath-Ustrova"
    params = SamplingParams(temperature=0.0, max_tokens=40, constraint=Constraint(choice=(choice,)))
    lookup = SpeculativeConfig("ngram", num_speculative_tokens=4, ngram_min=4, ngram_max=4)
    llm = LLM(speculative=lookup)
    (completion,) = llm.generate(["Name a place."], params)
    assert completion.text == choice
    assert completion.token_ids == LLM().generate(["Name a place."], params)[0].token_ids
    tokens = [*completion.prompt_token_ids, *completion.token_ids]
    four_grams = [tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3)]
    assert len(set(four_grams)) == len(four_grams)  # nothing for the lookup to find
    stats = llm.engine.stats()
    assert 0 < stats.num_accepted_draft_tokens <= stats.num_draft_tokens


def test_sampled_constrained_outputs_stay_valid_with_ngram_speculation() -> None:
    llm = LLM(speculative=NGRAM)
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=80, constraint=CONSTRAINTS[0])
        for seed in range(6)
    ]
    completions = [llm.chat(_conversations()[seed % 2], p)[0] for seed, p in enumerate(params)]
    for completion in completions:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), PERSON)
    assert llm.engine.stats().num_accepted_draft_tokens > 0


def test_constrained_requests_with_min_tokens_or_allowed_token_ids_verify_no_drafts() -> None:
    llm = LLM(speculative=NGRAM)
    vocab = llm.engine.model_info.vocab_size
    banning = [dict(min_tokens=2), dict(allowed_token_ids=list(range(vocab)))]
    for extra in banning:
        params = SamplingParams(temperature=0.0, max_tokens=60, constraint=CONSTRAINTS[0], **extra)
        llm.chat(_conversations(), params)
    assert llm.engine.stats().num_draft_tokens == 0
    llm.chat(_conversations(), SamplingParams(temperature=0.0, max_tokens=60, constraint=CONSTRAINTS[0]))
    assert llm.engine.stats().num_draft_tokens > 0
