"""A tool-using turn sent back: the assistant's tool calls and each tool's result, in the next request's
conversation. It must render as transformers renders the same conversation in the form it documents
(calls as {"id", "type": "function", "function": {"name", "arguments": <object>}}), with real templates:
Mistral's (mistral_common's generator; they refuse a call id that is not 9 characters) and Llama 4's
(transformers' own). Over gRPC, the calls a response returned go back, with their ids, in the next call.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest
from mistral_common.integrations.chat_templates.chat_templates import generate_chat_template
from mistral_common.tokens.tokenizers.base import TokenizerVersion
from service_harness import ServerThread, long_engine_config
from transformers import AutoTokenizer
from transformers.models.llama4.processing_llama4 import chat_template as LLAMA4_TEMPLATE

from sluice import Client, generate_request
from sluice.engine.errors import InvalidRequestError
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.tool_calls import Tool, ToolUse
from sluice.engine.text.chat_template import ChatTemplate
from sluice.engine.text.prompt import resolve_prompt
from sluice.engine.text.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(120)


def mistral_template(version: TokenizerVersion) -> str:
    return generate_chat_template(
        spm=False,
        tokenizer_version=version,
        image_support=False,
        audio_support=False,
        thinking_support=False,
        default_system_prompt=None,
        plain_thinking_support=False,
        use_special_token_variables=True,
        model_settings_fields=None,
        reasoning_effort_values=None,
        reasoning_effort_default=None,
    )


TEMPLATES = {
    "mistral_v3": mistral_template(TokenizerVersion.v3),
    "mistral_v7": mistral_template(TokenizerVersion.v7),
    "mistral_v11": mistral_template(TokenizerVersion.v11),
    "llama4": LLAMA4_TEMPLATE,
}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOL_USE = ToolUse((Tool("get_weather", "Weather in a city", json.dumps(CITY)),), "required")
QUESTION = {"role": "user", "content": "What is the weather in Oslo and in Rome?"}
CALLS = [("abcDEF123", {"city": "Oslo"}), ("Z9y8X7w6v", {"city": "Rome"})]
# The conversation in the form transformers documents, rendered by transformers: the reference.
REFERENCE = [
    QUESTION,
    {
        "role": "assistant",
        "tool_calls": [
            {"id": id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            for id, arguments in CALLS
        ],
    },
    *(
        {"role": "tool", "tool_call_id": id, "name": "get_weather", "content": f"{city['city']}: 12 C"}
        for id, city in CALLS
    ),
]
# The same conversation as callers send it: calls as Sluice returns them (arguments as JSON text, the
# content beside them empty), or as OpenAI clients send them (content null).
AS_RETURNED = [
    QUESTION,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": id, "name": "get_weather", "arguments": json.dumps(a)} for id, a in CALLS],
    },
    *REFERENCE[2:],
]
AS_OPENAI_SENDS = [
    QUESTION,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(a)}}
            for id, a in CALLS
        ],
    },
    *REFERENCE[2:],
]


@pytest.fixture(scope="module")
def tokenizers(llama_long_dir: str) -> tuple[Tokenizer, AutoTokenizer]:
    return Tokenizer.from_pretrained(llama_long_dir), AutoTokenizer.from_pretrained(llama_long_dir)


def reference_ids(hf: AutoTokenizer, template: str, conversation: list[dict]) -> list[int]:
    return hf.apply_chat_template(
        conversation,
        tools=TOOL_USE.for_template(),
        chat_template=template,
        tokenize=True,
        return_dict=False,
        add_generation_prompt=True,
    )


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize(
    "conversation", [AS_RETURNED, AS_OPENAI_SENDS, REFERENCE], ids=["sluice", "openai", "hf"]
)
def test_a_tool_turn_renders_as_transformers_renders_it(tokenizers, template: str, conversation) -> None:
    ours, hf = tokenizers
    ours.chat_template = ChatTemplate(TEMPLATES[template])
    expected = reference_ids(hf, TEMPLATES[template], REFERENCE)
    assert resolve_prompt(ours, messages=conversation, tools=TOOL_USE.for_template()) == expected
    text = ours.decode(expected)
    assert '"Oslo"' in text and "Rome: 12 C" in text  # the calls and the results are in the prompt


# A caller's tool whose schema has "type" after the properties.
TIME_SCHEMA = {"properties": {"tz": {"type": "string"}}, "required": ["tz"], "type": "object"}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME_SCHEMA},
}


@pytest.mark.parametrize("template", ["llama4", "mistral_v11"])
def test_a_callers_tool_renders_as_transformers_renders_it(tokenizers, template: str) -> None:
    """Its schema's keys in its own order (they rendered "type" first: another prompt than transformers')."""
    ours, hf = tokenizers
    ours.chat_template = ChatTemplate(TEMPLATES[template])
    (tool,) = ToolUse((Tool("get_time", "Time in a zone", json.dumps(TIME_SCHEMA)),)).for_template()
    assert json.dumps(tool) == json.dumps(TIME_TOOL)
    expected = hf.apply_chat_template(
        [QUESTION],
        tools=[TIME_TOOL],
        chat_template=TEMPLATES[template],
        tokenize=True,
        return_dict=False,
        add_generation_prompt=True,
    )
    assert resolve_prompt(ours, messages=[QUESTION], tools=[tool]) == expected


def assistant(*tool_calls: object) -> list[dict]:
    return [QUESTION, {"role": "assistant", "content": "", "tool_calls": list(tool_calls)}]


@pytest.mark.parametrize(
    ("conversation", "field", "message"),
    [
        (assistant({"id": "a", "name": "f", "arguments": "{oops"}), "messages[1].tool_calls[0].arguments",
         "is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
        # The escape the model may write (tool_calls.py keeps it an escape in a call it returns): a template
        # printed it as a character no UTF-8 holds, and the tokenizer raised TypeError (INTERNAL).
        (assistant({"id": "a", "name": "f", "arguments": '{"s": "\\ud83d"}'}),
         "messages[1].tool_calls[0].arguments",
         "holds a lone surrogate (\\ud83d), which a prompt's UTF-8 text cannot hold"),
        # Python's json reads NaN and Infinity, which a template then printed into the prompt as they are.
        (assistant({"id": "a", "name": "f", "arguments": '{"x": NaN}'}),
         "messages[1].tool_calls[0].arguments", "is not valid JSON: NaN is not a JSON number"),
        (assistant({"id": "a", "name": "f", "arguments": '{"x": [1e999]}'}),
         "messages[1].tool_calls[0].arguments", "holds NaN or a number past a float's range"),
        (assistant({"type": "function", "function": {"name": "f", "arguments": "[1]"}}),
         "messages[1].tool_calls[0].function.arguments", "must be a JSON object, got [1]"),
        (assistant({"name": "", "arguments": "{}"}), "messages[1].tool_calls[0].name",
         "must be a function's name, got ''"),
        (assistant({"function": "f"}), "messages[1].tool_calls[0].function",
         "must be a mapping with name and arguments, got 'f'"),
        (assistant("f"), "messages[1].tool_calls[0]", "must be a mapping with name and arguments, got 'f'"),
        ([QUESTION, {"role": "assistant", "tool_calls": "f"}], "messages[1].tool_calls",
         "must be a list of calls, got 'f'"),
    ],
)  # fmt: skip
def test_a_bad_tool_call_is_refused_naming_its_field(tokenizers, conversation, field, message) -> None:
    ours, _ = tokenizers
    ours.chat_template = ChatTemplate(TEMPLATES["llama4"])
    with pytest.raises(InvalidRequestError) as info:
        resolve_prompt(ours, messages=conversation)
    assert (info.value.field, str(info.value)) == (field, f"{field}: {message}")


@pytest.fixture(scope="module")
def mistral_dir(llama_long_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The long tiny Llama with Mistral's v7 template."""
    directory = tmp_path_factory.mktemp("mistral") / "llama"
    shutil.copytree(llama_long_dir, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": TEMPLATES["mistral_v7"]}))
    Path(directory / "chat_template.jinja").unlink(missing_ok=True)
    return directory


@pytest.fixture(scope="module")
def mistral_server(mistral_dir: Path):
    thread = ServerThread(long_engine_config(str(mistral_dir))).start()
    yield thread, AutoTokenizer.from_pretrained(mistral_dir)
    thread.stop()


def reference_turn(question: dict, calls: list[tuple[str, str, str]], results: list[dict]) -> list[dict]:
    """The conversation in transformers' documented form, from (id, name, arguments text) calls."""
    tool_calls = [
        {"id": id, "type": "function", "function": {"name": name, "arguments": json.loads(arguments)}}
        for id, name, arguments in calls
    ]
    return [question, {"role": "assistant", "tool_calls": tool_calls}, *results]


def test_the_offline_llms_completion_continues_the_conversation(mistral_dir: Path) -> None:
    llm = LLM(str(mistral_dir), block_size=16, num_blocks=256, attention_backend="torch")
    bias = {llm.tokenizer.token_to_id(t): 3.0 for t in ('"', "}", "]")}  # JSON that ends soon
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=3, logit_bias=bias)
    (completion,) = llm.chat([QUESTION], params, tool_use=TOOL_USE)
    assert completion.finish_reason == "stop" and completion.tool_calls, completion.text
    results = [{"role": "tool", "tool_call_id": call.id, "content": "12 C"} for call in completion.tool_calls]
    conversation = [QUESTION, completion.as_message(), *results]
    calls = [(call.id, call.name, call.arguments) for call in completion.tool_calls]
    hf = AutoTokenizer.from_pretrained(mistral_dir)
    expected = reference_ids(hf, TEMPLATES["mistral_v7"], reference_turn(QUESTION, calls, results))
    (answer,) = llm.chat([conversation], SamplingParams(max_tokens=2), tool_use=TOOL_USE)
    assert answer.prompt_token_ids == expected


def test_the_calls_a_response_returned_go_back_with_their_results(mistral_server) -> None:
    """Required calls of get_weather come back with 9-character ids and an empty content; the next
    request, built from `Completion.as_message()` and a result per call, is rendered as transformers
    renders it (Mistral's template refuses any other id) and runs."""
    server, hf = mistral_server
    tools = TOOL_USE.for_template()  # OpenAI's form of them
    with Client(server.target) as client:
        bias = {hf.convert_tokens_to_ids(t): 3.0 for t in ('"', "}", "]")}  # JSON that ends soon
        first = generate_request(
            messages=[QUESTION], tools=tools, tool_choice="required", max_tokens=200, temperature=1.0, seed=3
        )
        first.sampling_params.logit_bias.update(bias)
        completion = client.complete(first, timeout=60)
        assert completion.finish_reason_name == "stop", completion.text
        assert completion.tool_calls and completion.content == ""
        assert all(len(call.id) == 9 and call.id.isalnum() for call in completion.tool_calls)
        results = [
            {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": "12 C"}
            for call in completion.tool_calls
        ]
        conversation = [QUESTION, completion.as_message(), *results]
        calls = [(call.id, call.name, call.arguments) for call in completion.tool_calls]
        expected = reference_ids(hf, TEMPLATES["mistral_v7"], reference_turn(QUESTION, calls, results))
        assert client.tokenize(messages=conversation, tools=tools) == expected
        assert client.tokenize(messages=conversation) != expected  # without the tools, another prompt
        second = generate_request(messages=conversation, tools=tools, max_tokens=4, temperature=0.0)
        answer = client.complete(second, timeout=60)
        assert answer.usage.prompt_tokens == len(expected)
        assert answer.finish_reason_name in ("stop", "length")


def test_tool_call_arguments_that_are_not_an_object_are_invalid_argument(mistral_server) -> None:
    server, _ = mistral_server
    conversation = [
        QUESTION,
        {"role": "assistant", "tool_calls": [{"id": "abcDEF123", "name": "f", "arguments": '"Oslo"'}]},
    ]
    with server.channel() as channel, pytest.raises(grpc.RpcError) as info:
        list(server.stub(channel).Generate(generate_request(messages=conversation), timeout=60))
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "messages[1].tool_calls[0].arguments: must be a JSON object, got 'Oslo'",
    )
