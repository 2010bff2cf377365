"""A thinking chat's constraint applies once its reasoning has ended, as vLLM's grammar: the think block is
free text, and the answer after `</think>` matches the constraint (`Constraint.after_token_id`, set by the
output processor for a chat when the engine runs a reasoning parser).

Unit tests of the grammar mask on a seven-token vocabulary (the grammar's tokens and `</think>`): rows go
unmasked until the outputs hold `</think>`, also as a draft; a draft `</think>` rejected since moves the
grammar's start; drafts are kept through the first `</think>`. Then a tiny random-weight Qwen3 whose
tokenizer has `<think>` and `</think>` tokens, with a logit bias that makes it end its thinking after a few
sampled tokens (seeded): its think block is free text and its answer one of the choices, offline (sync,
async scheduling, ngram speculation, n = 2) and over gRPC (a JSON schema, a required tool call).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr
from checkpoints import (
    EOS_ID,
    IM_END_ID,
    THINK_TOKENS,
    VOCAB_SIZE,
    build_qwen3_thinking_checkpoint,
)
from service_harness import PATIENCE_S, ServerThread, tiny_engine_config
from test_speculative_structured import EOS, GRAMMAR, A, B, C, X, Y
from test_speculative_structured import VOCAB as SPECULATIVE_VOCAB

from sluice.engine.config import SpeculativeConfig
from sluice.engine.errors import InvalidRequestError
from sluice.engine.frontend.llm import LLM
from sluice.engine.sample.grammar_mask import GrammarMask, GrammarViolationError
from sluice.engine.sample.sampler import SamplingRow
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.constraint import Constraint
from sluice.engine.text.reasoning import ReasoningParser
from sluice.service import generate_command
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(300)

SLUICE = str(Path(sys.executable).parent / "sluice")

# The speculative tests' grammar and six tokens, and </think>.
T = len(SPECULATIVE_VOCAB)
VOCAB = [*SPECULATIVE_VOCAB, "</think>"]
EVERY_TOKEN = set(range(len(VOCAB)))


@pytest.fixture(scope="module")
def grammar() -> object:
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS]))
    return compiler.compile_grammar(GRAMMAR)


def _step(
    mask: GrammarMask, grammar: object, outputs: list[int], drafts: list[int] = (), after: int | None = T
) -> list[set[int]]:
    """The tokens each row of a step keeps once the mask is applied: a request with `outputs` verifying
    `drafts` (one row per draft and one after them, as `RejectionSampler.verify` expands them)."""
    params = SamplingParams(temperature=0.0, constraint=Constraint(grammar=GRAMMAR, after_token_id=after))
    rows = [
        SamplingRow("r", params, [A], [*outputs, *drafts[:j]], grammar=grammar, num_drafts=j)
        for j in range(len(drafts) + 1)
    ]
    logits = torch.zeros(len(rows), len(VOCAB))
    mask.apply(logits, rows)
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]


def test_the_grammar_applies_after_the_first_think_end(grammar) -> None:
    mask = GrammarMask()
    assert _step(mask, grammar, []) == [EVERY_TOKEN]
    assert _step(mask, grammar, [X, Y, C]) == [EVERY_TOKEN]  # thinking: any token
    assert _step(mask, grammar, [X, Y, C, T]) == [{A}]
    assert _step(mask, grammar, [X, Y, C, T, A]) == [{B}]
    # A later </think> is the grammar's to accept or refuse, as any token of the answer.
    with pytest.raises(GrammarViolationError):
        _step(mask, grammar, [X, Y, C, T, A, T])
    # Without after_token_id the grammar applies from the first token, </think> a token like the others.
    assert _step(GrammarMask(), grammar, [], after=None) == [{A}]
    with pytest.raises(GrammarViolationError):
        _step(GrammarMask(), grammar, [X, T], after=None)


def test_verify_rows_are_masked_from_a_think_end_among_the_drafts(grammar) -> None:
    assert _step(GrammarMask(), grammar, [X], [Y, T, A]) == [
        EVERY_TOKEN,
        EVERY_TOKEN,
        {A},
        {B},
    ]


def test_a_rejected_think_end_draft_moves_the_grammars_start(grammar) -> None:
    mask = GrammarMask()
    assert _step(mask, grammar, [X], [Y, T, A]) == [EVERY_TOKEN, EVERY_TOKEN, {A}, {B}]
    # y rejected, </think> sampled in its place: the grammar starts one token earlier.
    assert _step(mask, grammar, [X, T], [A, B]) == [{A}, {B}, {A, C}]
    # The next step: a and b accepted; their rejected drafts are rolled back, the start kept.
    assert _step(mask, grammar, [X, T, A, B, C]) == [{Y}]

    mask = GrammarMask()
    assert _step(mask, grammar, [X], [T, A]) == [EVERY_TOKEN, {A}, {B}]
    # </think> rejected: thinking goes on, unmasked; it ends later, and the grammar starts there.
    assert _step(mask, grammar, [X, Y], [C]) == [EVERY_TOKEN, EVERY_TOKEN]
    assert _step(mask, grammar, [X, Y, C, T, A]) == [{B}]


def test_a_freed_requests_start_is_forgotten(grammar) -> None:
    mask = GrammarMask()
    assert _step(mask, grammar, [X, T]) == [{A}]
    mask.free(["r"])
    assert _step(mask, grammar, [X, Y]) == [EVERY_TOKEN]  # another request of that id


def test_drafts_are_kept_through_the_first_think_end(grammar) -> None:
    mask = GrammarMask()
    assert mask.constrained_drafts("r", grammar, [X], (Y, T, A, B), 5, T) == (2, ())
    assert mask.constrained_drafts("r", grammar, [X], (Y, C, Y), 5, T) == (3, ())  # free text
    assert mask.constrained_drafts("r", grammar, [X], (Y, C, Y), 2, T) == (2, ())  # k at most
    # Once the outputs hold it, the grammar's drafts as without a think block: kept, then forced.
    assert mask.constrained_drafts("r", grammar, [X, T], (A, C), 5, T) == (1, (B,))
    assert mask.constrained_drafts("r", grammar, [X, T], (), 5, T) == (0, (A, B))
    assert _step(mask, grammar, [X, T, A]) == [{B}]  # the matcher left as the outputs leave it


CHOICES = ("yes", "no")
THINK_END_ID = VOCAB_SIZE + THINK_TOKENS.index("</think>")
# Enough that the model ends its thinking after a few sampled tokens (seeds 0-4 think for 5 to 20).
ENDS_THINKING = {THINK_END_ID: 6.0}


@pytest.fixture(scope="module")
def qwen3_thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_qwen3_thinking_checkpoint(str(tmp_path_factory.mktemp("qwen3_thinking")))


def _ends_thinking(seed: int, **fields: object) -> SamplingParams:
    """Seeded sampling that ends the thinking after a few tokens, then one of the choices."""
    constraint = Constraint(choice=CHOICES)
    return SamplingParams(
        max_tokens=60, temperature=1.0, seed=seed, logit_bias=ENDS_THINKING, constraint=constraint, **fields
    )


def _thinks_then_answers(token_ids: tuple[int, ...], reasoning: str, text: str) -> None:
    """A think block of free text (not an answer), then the constraint's answer."""
    assert token_ids.count(THINK_END_ID) == 1, token_ids
    assert token_ids.index(THINK_END_ID) > 0 and reasoning.strip()
    assert text in CHOICES


@pytest.mark.parametrize("mode", ["sync", "async", "ngram"])
def test_a_thinking_chat_thinks_before_its_constrained_answer(qwen3_thinking_dir: str, mode: str) -> None:
    speculative = SpeculativeConfig("ngram", num_speculative_tokens=3) if mode == "ngram" else None
    llm = LLM(
        qwen3_thinking_dir,
        reasoning_parser="qwen3",
        num_blocks=64,
        attention_backend="torch",
        async_scheduling=mode == "async",
        speculative=speculative,
    )
    for seed in range(3):
        params = _ends_thinking(seed, n=2)
        completions = llm.chat([{"role": "user", "content": "Is it raining?"}], params)
        assert len(completions) == 2
        for completion in completions:
            assert completion.finish_reason == "stop"
            _thinks_then_answers(completion.token_ids, completion.reasoning, completion.text)
    # A plain prompt is no chat: its constraint applies from the first token.
    (plain,) = llm.generate("Is it raining?", dataclasses.replace(params, n=1))
    assert plain.text in CHOICES and THINK_END_ID not in plain.token_ids


def test_eos_while_thinking_ends_the_output_as_without_a_constraint(qwen3_thinking_dir: str) -> None:
    """Before `</think>` no grammar decides where the output ends: an eos there ends it, unless min_tokens
    holds it back or ignore_eos is set; after it, the complete constraint ends the output, ignore_eos or
    not (docs/API.md)."""
    llm = LLM(qwen3_thinking_dir, reasoning_parser="qwen3", num_blocks=64, attention_backend="torch")
    favours_eos = SamplingParams(
        max_tokens=12, temperature=0.0, logit_bias={EOS_ID: 50.0}, constraint=Constraint(choice=CHOICES)
    )
    messages = [{"role": "user", "content": "Is it raining?"}]
    (ended,) = llm.chat(messages, favours_eos)
    assert (ended.token_ids, ended.finish_reason) == ([EOS_ID], "stop")
    (held,) = llm.chat(messages, dataclasses.replace(favours_eos, min_tokens=8))
    assert EOS_ID not in held.token_ids[:8] and held.token_ids[-1] == EOS_ID and held.finish_reason == "stop"
    (ignored,) = llm.chat(messages, dataclasses.replace(favours_eos, ignore_eos=True))
    assert (len(ignored.token_ids), ignored.finish_reason) == (12, "length")
    (answered,) = llm.chat(messages, _ends_thinking(0, ignore_eos=True))
    assert answered.finish_reason == "stop" and answered.token_ids[-1] in (EOS_ID, IM_END_ID)
    _thinks_then_answers(answered.token_ids, answered.reasoning, answered.text)


def test_a_constraint_that_writes_the_think_end_shapes_the_think_block_too(qwen3_thinking_dir: str) -> None:
    """A regex naming `</think>` (also escaped, `<\\/think>`) applies from the first token: it forces
    the think block, which is split off as reasoning."""
    llm = LLM(qwen3_thinking_dir, reasoning_parser="qwen3", num_blocks=64, attention_backend="torch")
    for regex in (r"<think>ab</think>(yes|no)", r"<think>ab<\/think>(yes|no)"):
        params = SamplingParams(max_tokens=30, temperature=0.0, constraint=Constraint(regex=regex))
        (completion,) = llm.chat([{"role": "user", "content": "Is it raining?"}], params)
        assert (completion.reasoning, completion.text in CHOICES) == ("ab", True), regex
        assert completion.token_ids.count(THINK_END_ID) == 1


# Qwen3's way with an assistant turn: its think block, closed, before its content (so that a prefilled
# answer continued with continue_final_message follows a closed block).
THINK_BLOCK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}<think>\n{{ m.get('reasoning_content', '') }}\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _copy(model_dir: str, tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    directory = tmp_path_factory.mktemp(name) / "model"
    shutil.copytree(model_dir, directory)
    return directory


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


@pytest.fixture(scope="module")
def think_block_llm(qwen3_thinking_dir: str, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    directory = _copy(qwen3_thinking_dir, tmp_path_factory, "think_block_template")
    _edit_json(
        directory / "tokenizer_config.json", lambda config: config.update(chat_template=THINK_BLOCK_TEMPLATE)
    )
    (directory / "chat_template.jinja").write_text(THINK_BLOCK_TEMPLATE)  # transformers 5 reads it first
    return LLM(str(directory), reasoning_parser="qwen3", num_blocks=64, attention_backend="torch")


def test_a_prefilled_answer_after_a_closed_think_block_is_constrained_from_its_first_token(
    think_block_llm: LLM,
) -> None:
    """The prompt's last think tag, found by token id however long the prefilled answer after it (it was
    looked for in the prompt's last 16 tokens), closes the block: no thinking, the constraint applies."""
    schema = {"type": "object", "properties": {"answer": {"enum": list(CHOICES)}}, "required": ["answer"]}
    params = SamplingParams(
        max_tokens=40, temperature=0.0, constraint=Constraint(json_schema=json.dumps(schema))
    )
    for prefix in ("Sure: ", "Sure, here is the answer, as the JSON object that you asked me for: "):
        conversation = [
            {"role": "user", "content": "Is it raining? Answer in JSON."},
            {"role": "assistant", "content": prefix, "reasoning_content": "It is cloudy."},
        ]
        (completion,) = think_block_llm.chat(
            conversation, params, continue_final_message=True, add_generation_prompt=False
        )
        assert completion.finish_reason == "stop" and completion.reasoning == "", prefix
        jsonschema.validate(json.loads(completion.text), schema)


def test_an_earlier_turns_closed_think_block_leaves_the_new_turn_thinking(think_block_llm: LLM) -> None:
    """The search for the prompt's last think tag stops at the eos that ends an earlier turn."""
    conversation = [
        {"role": "user", "content": "Rain?"},
        {"role": "assistant", "content": "no", "reasoning_content": "dry"},
        {"role": "user", "content": "Now?"},
    ]
    for seed in range(3):
        (completion,) = think_block_llm.chat(conversation, _ends_thinking(seed))
        _thinks_then_answers(completion.token_ids, completion.reasoning, completion.text)


def test_allowed_token_ids_of_eos_ids_alone_are_refused_with_or_without_a_constraint(
    qwen3_thinking_dir: str,
) -> None:
    """Without a constraint min_tokens leaves none of them (refused up front); with one, which cannot wait
    for a `</think>` the request cannot write, the constraint accepts none of them at the first token."""
    llm = LLM(qwen3_thinking_dir, reasoning_parser="qwen3", num_blocks=64, attention_backend="torch")
    params = SamplingParams(max_tokens=6, min_tokens=2, allowed_token_ids=(EOS_ID, IM_END_ID))
    message = [{"role": "user", "content": "Is it raining?"}]
    for constraint, refusal in (
        (None, "^min_tokens: holds back every allowed_token_ids"),
        (
            Constraint(choice=CHOICES),
            "^allowed_token_ids: none is a token the constraint accepts at output token 0",
        ),
    ):
        with pytest.raises(InvalidRequestError, match=refusal):
            llm.chat(message, dataclasses.replace(params, constraint=constraint))


@pytest.fixture(scope="module")
def special_think_end_dir(qwen3_thinking_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The thinking Qwen3 with `</think>` a special token (skip_special_tokens drops its text)."""
    directory = _copy(qwen3_thinking_dir, tmp_path_factory, "special_think_end")

    def special(tokenizer: dict) -> None:
        for added in tokenizer["added_tokens"]:
            added["special"] = added["special"] or added["content"] == "</think>"

    _edit_json(directory / "tokenizer.json", special)
    return str(directory)


@pytest.mark.parametrize("rules_it_out", ["allowed_token_ids", "stop_token_ids", "special"])
def test_a_chat_that_cannot_write_the_think_end_is_constrained_from_its_first_token(
    qwen3_thinking_dir: str, special_think_end_dir: str, rules_it_out: str
) -> None:
    """Where the request cannot write `</think>` (allowed_token_ids without it, stop_token_ids with it) or
    its text would not reach the split (a special token, skipped), waiting for it would leave the output
    unconstrained: the constraint applies from the first token, the output all content."""
    directory = special_think_end_dir if rules_it_out == "special" else qwen3_thinking_dir
    llm = LLM(directory, reasoning_parser="qwen3", num_blocks=64, attention_backend="torch")
    params = _ends_thinking(0)
    if rules_it_out == "allowed_token_ids":
        spelled = {t for choice in CHOICES for t in llm.tokenizer.encode(choice, add_special_tokens=False)}
        params = dataclasses.replace(params, allowed_token_ids=(*spelled, EOS_ID, IM_END_ID))
    elif rules_it_out == "stop_token_ids":
        params = dataclasses.replace(params, stop_token_ids=(THINK_END_ID,))
    (completion,) = llm.chat([{"role": "user", "content": "Is it raining?"}], params)
    assert (completion.reasoning, completion.text in CHOICES, completion.finish_reason) == ("", True, "stop")
    assert THINK_END_ID not in completion.token_ids


def test_a_constrained_chats_reasoning_ends_at_the_think_end_alone() -> None:
    """qwen3's split ends the reasoning at a `<tool_call><function=` too; a constrained chat's starts its
    constraint at `</think>`, so its reasoning ends there alone: the call written while thinking is
    reasoning."""
    text = "hm <tool_call>\n<function=get_time>\n</function>\n</tool_call></think>{}"
    assert ReasoningParser.split("qwen3", text) == ("hm ", text[3:])
    parser = ReasoningParser("qwen3", only_think_end=True)
    assert parser.feed(text, final=True) == (text[: text.index("</think>")], "{}")


@pytest.mark.parametrize("value", [-1, 1.5, True, "513"])
def test_after_token_id_must_be_a_token_id(value) -> None:
    with pytest.raises(ValueError, match="after_token_id: must be a token id"):
        Constraint(json_object=True, after_token_id=value)


@pytest.fixture(scope="module")
def server(qwen3_thinking_dir: str):
    config = tiny_engine_config(qwen3_thinking_dir)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, reasoning_parser="qwen3"))
    thread = ServerThread(config).start()
    yield thread
    thread.stop()


def _chat(seed: int, **fields: object) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=80, temperature=1.0, seed=seed, logit_bias=ENDS_THINKING)
    for name, value in fields.pop("sampling", {}).items():
        setattr(sampling, name, value)
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Weather?")], **fields)
    return pb.GenerateRequest(messages=messages, sampling_params=sampling)


def test_a_json_answer_follows_the_think_block_over_grpc(stub) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": list(CHOICES)}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    for seed in range(3):
        request = _chat(seed, sampling={"json_schema": json.dumps(schema)})
        chunks = list(stub.Generate(request, timeout=120))
        assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP
        token_ids = tuple(t for c in chunks for t in c.token_ids)
        reasoning = "".join(c.reasoning_text for c in chunks)
        text = "".join(c.text for c in chunks)
        assert token_ids.count(THINK_END_ID) == 1 and reasoning.strip()
        jsonschema.validate(json.loads(text), schema)


def test_a_required_tool_call_follows_the_think_block_over_grpc(stub) -> None:
    time_tool = pb.Tool(name="get_time", description="The time now", parameters="")
    required = pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)
    chunks = list(stub.Generate(_chat(1, tools=[time_tool], tool_choice=required), timeout=120))
    assert [c.name for c in chunks[-1].tool_calls] == ["get_time"]
    assert "".join(c.reasoning_text for c in chunks).strip()
    assert THINK_END_ID in [t for c in chunks for t in c.token_ids]


def test_sluice_generate_writes_the_reasoning_to_stderr_and_the_answer_to_stdout(stub, server) -> None:
    """Greedy, the tiny model never writes `</think>` here: its output is all reasoning, so stdout is
    empty and stderr holds the reasoning, then the stats line on a line of its own."""
    request = _chat(0, sampling={"temperature": 0.0, "max_tokens": 12})
    request.sampling_params.logit_bias.clear()
    request.sampling_params.ClearField("seed")
    chunks = list(stub.Generate(request, timeout=120))
    reasoning = "".join(c.reasoning_text for c in chunks)
    assert reasoning and not "".join(c.text for c in chunks)
    command = [SLUICE, "generate", "--target", server.target, "--max-tokens", "12", "Weather?"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=PATIENCE_S)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    # The reasoning, then the stats line on a line of its own (anything the process warns of before).
    assert (reasoning + ("" if reasoning.endswith("\n") else "\n")) in result.stderr, result.stderr
    after = result.stderr[result.stderr.index(reasoning) + len(reasoning) :].lstrip("\n")
    assert re.fullmatch(r"12 tokens in .*TTFT \d+ ms\n", after), result.stderr


def test_sluice_generate_starts_the_answer_on_a_line_of_its_own(monkeypatch, capsys) -> None:
    """The reasoning streams to stderr, then the answer to stdout after a newline there (what a terminal
    shows in order), and the stats line after a newline on stdout."""
    chunks = [
        pb.GenerateResponse(token_ids=[5], reasoning_text="let me"),
        pb.GenerateResponse(token_ids=[6], reasoning_text=" think"),
        pb.GenerateResponse(token_ids=[7, 8], text="Paris"),
        pb.GenerateResponse(token_ids=[9], finish_reason=pb.FINISH_REASON_STOP),
    ]
    monkeypatch.setattr(generate_command.Client, "generate", lambda self, request, timeout: iter(chunks))
    parser = argparse.ArgumentParser()
    generate_command.configure(parser)
    assert generate_command.run(parser.parse_args(["--target", "localhost:1", "Capital of France?"])) == 0
    out, err = capsys.readouterr()
    assert out == "Paris\n"
    assert err.startswith("let me think\n5 tokens in ")
