"""Constrained decoding on a tiny random-weight model, the hardest case: it has no idea what JSON is, so
every valid output is the grammar mask's doing. Outputs are checked with `jsonschema`, `json` and `re`."""

from __future__ import annotations

import dataclasses
import gc
import json
import re

import jsonschema
import pytest
import torch

from sluice.engine.errors import ContextLengthError, InvalidRequestError
from sluice.engine.frontend.llm import LLM
from sluice.engine.request import Request
from sluice.engine.sample.grammar_mask import _no_token_left
from sluice.engine.sample.sampler import SamplingRow
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint

SCHEMAS = {
    "nested_objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "name": {"type": "string", "maxLength": 6},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array_min_max_items": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M"]},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "minimum": 10, "maximum": 20},
        },
        "required": ["score", "count"],
        "additionalProperties": False,
    },
    "required_and_optional": {
        "type": "object",
        "properties": {
            "a": {"type": "boolean"},
            "b": {"type": "null"},
            "c": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    "string_patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        },
        "required": ["code", "zip"],
        "additionalProperties": False,
    },
}
REGEXES = [
    r"[0-9]{3}-[a-z]{2,4}",
    r"(true|false)",
    r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}",
    r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)",
]
# A JSON array of 0 to 5 small integers, so `json.loads` is the reference parser.
EBNF = 'root ::= "[" (int ("," int){0,4})? "]"\nint ::= "-"? [1-9] [0-9]{0,2} | "0"'
PROMPTS = ["hello", "the cat sat on", "1 2 3", "JSON please:", "<tag>", "x"]


def sampled(constraint: Constraint, i: int, max_tokens: int = 200) -> SamplingParams:
    """Greedy for the first two prompts, seeded random draws for the others."""
    temperature = 0.0 if i < 2 else 1.0
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, constraint=constraint)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(llama_dir: str, request: pytest.FixtureRequest) -> LLM:
    """Synchronous steps, then async scheduling's (a grammar follows the token still in flight on the
    host before the mask of the step launched after it: sluice.engine.core.launched_step)."""
    return LLM(
        llama_dir,
        block_size=16,
        num_blocks=256,
        max_num_seqs=64,
        attention_backend="torch",
        async_scheduling=request.param,
    )


def test_every_output_validates_against_its_json_schema(llm: LLM) -> None:
    prompts, params, names = [], [], []
    for name, schema in SCHEMAS.items():
        for i, prompt in enumerate(PROMPTS):
            prompts.append(prompt)
            params.append(sampled(Constraint(json_schema=json.dumps(schema)), i))
            names.append(name)
    completions = llm.generate(prompts, params)
    for name, completion in zip(names, completions, strict=True):
        assert completion.finish_reason == "stop", (name, completion.text)
        jsonschema.validate(json.loads(completion.text), SCHEMAS[name])


def test_json_object_outputs_are_json_objects(llm: LLM) -> None:
    # Free strings never end by chance with this model; a bias towards closing them (applied before the
    # mask, so it cannot allow anything the grammar forbids) keeps outputs within max_tokens.
    bias = {llm.tokenizer.token_to_id(t): 4.0 for t in ('"', "}")}
    params = [
        dataclasses.replace(sampled(Constraint(json_object=True), i), logit_bias=bias)
        for i in range(len(PROMPTS))
    ]
    for completion in llm.generate(PROMPTS, params):
        assert completion.finish_reason == "stop", completion.text
        assert isinstance(json.loads(completion.text), dict)


def test_every_output_fully_matches_its_regex(llm: LLM) -> None:
    params = [sampled(Constraint(regex=r), i) for r in REGEXES for i in range(len(PROMPTS))]
    completions = llm.generate(PROMPTS * len(REGEXES), params)
    for param, completion in zip(params, completions, strict=True):
        assert completion.finish_reason == "stop"
        assert re.fullmatch(param.constraint.regex, completion.text), (
            param.constraint.regex,
            completion.text,
        )


def test_every_output_is_a_sentence_of_the_ebnf_grammar(llm: LLM) -> None:
    params = [sampled(Constraint(grammar=EBNF), i) for i in range(len(PROMPTS))]
    for completion in llm.generate(PROMPTS, params):
        assert completion.finish_reason == "stop"
        value = json.loads(completion.text)
        assert isinstance(value, list) and len(value) <= 5 and all(-999 <= v <= 999 for v in value)
        assert re.fullmatch(r"\[((0|-?[1-9][0-9]{0,2})(,(0|-?[1-9][0-9]{0,2})){0,4})?\]", completion.text)


def test_choice_returns_exactly_one_of_the_choices(llm: LLM) -> None:
    choices = ("yes", "no", "maybe so", "yes!")
    params = [sampled(Constraint(choice=choices), i) for i in range(len(PROMPTS))]
    texts = [c.text for c in llm.generate(PROMPTS, params)]
    assert all(text in choices for text in texts), texts
    # With special tokens shown, the EOS that ends the choice is still no part of it (its text once was).
    shown = [dataclasses.replace(p, skip_special_tokens=False) for p in params]
    completions = llm.generate(PROMPTS, shown)
    assert [c.text for c in completions] == texts
    assert all(c.token_ids[-1] == c.stop_reason for c in completions)  # the EOS is kept as a token


@pytest.mark.parametrize(
    "extra", [{"ignore_eos": True}, {"min_tokens": 30}, {"ignore_eos": True, "min_tokens": 30}]
)
def test_a_constraint_ends_the_output_whatever_ignore_eos_and_min_tokens_say(llm: LLM, extra) -> None:
    """Once a choice is complete only eos matches it: the request stops there (it used to go on and fail)."""
    choices = ("yes", "no", "maybe so")
    params = [dataclasses.replace(sampled(Constraint(choice=choices), i, 40), **extra) for i in range(4)]
    completions = llm.generate(PROMPTS[:4], params)
    assert [c.finish_reason for c in completions] == ["stop"] * 4
    assert all(c.text in choices for c in completions), [c.text for c in completions]
    assert all(c.token_ids[-1] in llm.engine.core.eos_token_ids for c in completions)
    assert not llm.engine.has_unfinished_requests()


def test_parameters_that_leave_the_constraint_no_token_name_their_field(llm: LLM) -> None:
    """The mask runs after allowed_token_ids and min_tokens: where they leave none of the tokens the
    constraint accepts, the request is refused naming the field instead of drawing a token that breaks the
    constraint, and the other requests are not touched."""
    [red] = llm.generate(["hello"], SamplingParams(temperature=0.0, constraint=Constraint(choice=("red",))))
    outside = [t for t in range(1, 50) if t not in red.token_ids][:3]
    dead_end = SamplingParams(constraint=Constraint(choice=("red",)), allowed_token_ids=outside)
    with pytest.raises(
        InvalidRequestError, match=r"^allowed_token_ids: none is a token the constraint accepts at "
    ):
        llm.generate(["hello", "world"], [dead_end, SamplingParams(max_tokens=4)])
    assert not llm.engine.has_unfinished_requests()
    # All but eos are stop tokens min_tokens holds back: only eos is left, and "red" cannot start with it.
    stops = [t for t in range(llm.engine.model_info.vocab_size) if t not in llm.engine.core.eos_token_ids]
    held_back = SamplingParams(constraint=Constraint(choice=("red",)), min_tokens=4, stop_token_ids=stops)
    with pytest.raises(
        InvalidRequestError, match=r"^min_tokens: holds back stop_token_ids, the only tokens .* 0$"
    ):
        llm.generate(["hello"], held_back)
    # Tokens the constraint can use are allowed: the same request completes.
    allowed = SamplingParams(
        temperature=0.0, constraint=Constraint(choice=("red",)), allowed_token_ids=red.token_ids
    )
    assert llm.generate(["hello"], allowed)[0].text == "red"


@pytest.mark.parametrize("vocab", [64, 70, 95])
def test_no_token_left_is_read_from_the_bitmask_below_the_vocabulary(vocab) -> None:
    """The check the mask makes on the host instead of reading the masked logits: the allowed bits below
    the vocabulary, less what allowed_token_ids and min_tokens ban. One bit set at a time, the top bit of
    a word (a negative int32) and bits past the vocabulary in its last word included."""
    plain = SamplingParams()
    listed = SamplingParams(allowed_token_ids=[3, 40])
    held = SamplingParams(min_tokens=2, stop_token_ids=[3, 40])
    for token in [None, *range(((vocab + 31) // 32) * 32)]:
        words = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
        if token is not None:
            words[token // 32] = 1 << token % 32 if token % 32 < 31 else -(2**31)
        inside = token is not None and token < vocab
        assert _no_token_left(words, SamplingRow("r", plain, [1], []), vocab) == (not inside)
        assert _no_token_left(words, SamplingRow("r", listed, [1], []), vocab) == (token not in (3, 40))
        held_back = SamplingRow("r", held, [1], [5])  # one output: 3 and 40 held back until two
        assert _no_token_left(words, held_back, vocab) == (not inside or token in (3, 40))
        assert _no_token_left(words, SamplingRow("r", held, [1], [5, 5]), vocab) == (not inside)


def test_constrained_requests_leave_unconstrained_greedy_outputs_unchanged(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = [c.token_ids for c in llm.generate(PROMPTS, greedy)]
    schema = Constraint(json_schema=json.dumps(SCHEMAS["nested_objects"]))
    mixed_params = [greedy] * len(PROMPTS) + [sampled(schema, i) for i in range(len(PROMPTS))]
    mixed_params += [SamplingParams(max_tokens=24, allowed_token_ids=[5, 6], logit_bias={5: 3.0})]
    mixed = llm.generate(PROMPTS * 2 + ["z"], mixed_params)
    assert [c.token_ids for c in mixed[: len(PROMPTS)]] == alone
    assert set(mixed[-1].token_ids) <= {5, 6}


def test_preempted_constrained_requests_recompute_to_the_same_valid_outputs(llama_dir: str, llm: LLM) -> None:
    constraint = Constraint(json_schema=json.dumps(SCHEMAS["nested_objects"]))
    prompts = [f"{p} {p} {p}" for p in PROMPTS] * 2
    params = [SamplingParams(max_tokens=120, temperature=0.0, constraint=constraint)] * len(prompts)
    roomy = [c.token_ids for c in llm.generate(prompts, params)]
    small = LLM(llama_dir, block_size=16, num_blocks=14, max_num_seqs=12, attention_backend="torch")
    completions = small.generate(prompts, params)
    assert small.engine.stats().num_preemptions > 0
    assert [c.token_ids for c in completions] == roomy
    for completion in completions:
        jsonschema.validate(json.loads(completion.text), SCHEMAS["nested_objects"])


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint(json_schema='{"type": "foo"}'), 'json_schema: does not compile: Unsupported type "foo"'),
        (Constraint(regex="a(b"), "regex: does not compile: Regex parsing error at position 4"),
        (Constraint(regex="x[a-z"), "regex: does not compile: Regex parsing error at position 6"),
        (
            Constraint(grammar="root ::= foo"),
            "grammar: does not compile: EBNF parser error at line 1, column 10",
        ),
    ],
)
def test_a_constraint_that_does_not_compile_names_its_field(llm: LLM, constraint, message) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["hello", "world"], [SamplingParams(constraint=constraint), SamplingParams()])
    assert info.value.field == constraint.kind
    assert str(info.value).startswith(message), str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_requests_refused_for_a_cached_grammar_error_are_not_kept(llm: LLM) -> None:
    """The compiler's cache hands every request of one source the same failed future: re-raising its one
    exception chained each refused request's frame onto that exception's traceback, keeping the request
    (and the step's scheduler output) for as long as the cache kept the future. Found by a server soak."""
    constraint = Constraint(regex="(a|b")
    for _ in range(3):
        with pytest.raises(InvalidRequestError, match=r"^regex: does not compile: "):
            llm.generate(["hello"], SamplingParams(constraint=constraint))
    gc.collect()
    requests = [o for o in gc.get_objects() if type(o) is Request]
    assert [r.request_id for r in requests if r.sampling_params.constraint == constraint] == []


def test_a_constrained_request_the_kv_cache_cannot_hold_raises_context_length_error(llama_dir: str) -> None:
    """The scheduler refuses it only once its grammar compiled, in a later step: the same error as an
    unconstrained one gets at once (ContextLengthError naming max_tokens), not a plain InvalidRequestError."""
    small = LLM(llama_dir, block_size=16, num_blocks=4, attention_backend="torch")
    params = SamplingParams(max_tokens=100, constraint=Constraint(choice=("red", "green")))
    for request_params in (params, dataclasses.replace(params, constraint=None)):
        with pytest.raises(ContextLengthError, match=r"^max_tokens: needs 7 KV blocks but the cache has 4$"):
            small.generate([[7] * 10], request_params)
        assert not small.engine.has_unfinished_requests()


def test_constraints_are_validated_when_built() -> None:
    with pytest.raises(ValueError, match=r"^json_schema: is not valid JSON"):
        Constraint(json_schema="{")
    with pytest.raises(ValueError, match=r"^constraint: give exactly one of .* \(got regex, choice\)"):
        Constraint(regex="a", choice=("a",))
    with pytest.raises(ValueError, match=r"^choice: must hold at least one non-empty string"):
        Constraint(choice=("a", ""))
    assert Constraint(choice="yes").choice == ("yes",)  # one choice, not its characters
    assert Constraint(json_schema={"type": "integer"}).json_schema == '{"type": "integer"}'
    with pytest.raises(ValueError, match=r"^regex: must be a string, got 5$"):
        Constraint(regex=5)
    with pytest.raises(ValueError, match=r"^choice: must be strings, got \['a', 1\]$"):
        Constraint(choice=["a", 1])


@pytest.mark.parametrize(
    ("schema", "keyword", "path"),
    [
        ({"not": {"type": "integer"}}, "not", "#"),
        ({"allOf": [{"type": "integer"}, {"minimum": 10}]}, "allOf", "#"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "#"),
        ({"type": "array", "contains": {"const": 5}}, "contains", "#"),
        ({"type": "object", "properties": {"a": {"if": {}, "then": {}}}}, "if", "#/properties/a"),
        (
            {"$defs": {"d": {"dependentRequired": {"a": ["b"]}}}, "$ref": "#/$defs/d"},
            "dependentRequired",
            "#/$defs/d",
        ),
    ],
)
def test_a_json_schema_keyword_the_grammar_cannot_enforce_is_refused(schema, keyword, path) -> None:
    """xgrammar compiled these without enforcing them (outputs broke them and were called valid)."""
    message = f"json_schema: '{keyword}' at {path} is a keyword the grammar cannot enforce"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        Constraint(json_schema=json.dumps(schema))
    # A property named like a keyword is no keyword; one allOf branch and oneOf (as anyOf) compile.
    for fine in (
        {"properties": {"not": {}}},
        {"allOf": [{"type": "integer"}]},
        {"oneOf": [{"type": "integer"}]},
    ):
        Constraint(json_schema=json.dumps(fine))


def test_a_repeated_constraint_compiles_once(llm: LLM) -> None:
    grammars = llm.engine.core.grammars
    constraint = Constraint(regex="(ab){1,3}c")
    compiles, hits = grammars.num_compiles, grammars.num_cache_hits
    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=16, constraint=constraint))
    assert (grammars.num_compiles, grammars.num_cache_hits) == (compiles + 1, hits + 2)
