"""Chat template options as vLLM's chat API takes them: ChatMessages' `chat_template_kwargs`,
`add_generation_prompt` and `continue_final_message` (and `LLM.chat`'s keywords of those names). The prompt
token ids equal transformers' `apply_chat_template` with the same arguments, over gRPC (Tokenize, and
Generate's prompt logprobs) and offline; every refusal is INVALID_ARGUMENT naming its field."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from service_harness import ServerThread, tiny_engine_config
from transformers import AutoTokenizer

from sluice import Client, generate_request
from sluice.engine.errors import InvalidRequestError
from sluice.engine.frontend.llm import LLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.text.chat_template import ChatTemplate, ChatTemplateOptions
from sluice.engine.text.prompt import resolve_prompt
from sluice.engine.text.tokenizer import Tokenizer
from sluice.v1 import sluice_pb2 as pb

pytestmark = pytest.mark.timeout(180)

# Qwen3's template in small: reasoning in <think> tags, and `enable_thinking` false closes an empty <think>
# block after the generation prompt. `thinking_budget` (Seed-OSS's templates print one) is printed as the
# template gets it: 512, not 512.0.
TEMPLATE = (
    "{%- if thinking_budget is defined %}"
    "{{- '<|im_start|>system\\nThink for at most ' ~ thinking_budget ~ ' tokens.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.reasoning_content is defined %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{{- message.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
KWARGS = [
    {"enable_thinking": False},
    {"enable_thinking": False, "thinking_budget": 512},
    {"enable_thinking": True, "thinking_budget": 1024},
]
# Prefills the model continues; "end" is also in the "<|im_end|>" after it, where a search for the content
# from the end of the render would cut.
PREFILLS = ["The answer is", "end", "Sure, ", ""]


@pytest.fixture(scope="module")
def model_dir(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with TEMPLATE as its chat template."""
    directory = tmp_path_factory.mktemp("qwen3_style") / "llama"
    shutil.copytree(llama_dir, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    return directory


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> AutoTokenizer:
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir: Path):
    thread = ServerThread(tiny_engine_config(str(model_dir))).start()
    yield thread
    thread.stop()


def reference(hf: AutoTokenizer, messages: list[dict], **kwargs: object) -> list[int]:
    """transformers' prompt token ids (its add_generation_prompt defaults to false: the callers pass it)."""
    return hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)


def generate_prompt_ids(server: ServerThread, request: pb.GenerateRequest) -> tuple[int, list[int]]:
    """Generate's prompt: its length (usage) and its token ids after the first (prompt logprobs)."""
    request.sampling_params.max_tokens = 1
    request.sampling_params.prompt_logprobs = 0
    with server.channel() as channel:
        chunks = list(server.stub(channel).Generate(request, timeout=60))
    entries = [entry.sampled.token_id for chunk in chunks for entry in chunk.prompt_logprobs]
    return chunks[-1].usage.prompt_tokens, entries


@pytest.mark.parametrize("kwargs", KWARGS, ids=json.dumps)
def test_chat_template_kwargs_render_as_transformers(server: ServerThread, hf, kwargs: dict) -> None:
    expected = reference(hf, CHAT, add_generation_prompt=True, **kwargs)
    assert expected != reference(hf, CHAT, add_generation_prompt=True)  # the kwargs change the prompt
    with Client(server.target) as client:
        assert client.tokenize(messages=CHAT, chat_template_kwargs=kwargs) == expected
    request = generate_request(messages=CHAT, chat_template_kwargs=kwargs, temperature=0.0)
    assert generate_prompt_ids(server, request) == (len(expected), expected[1:])


def test_add_generation_prompt_false_renders_as_transformers(server: ServerThread, hf) -> None:
    expected = reference(hf, CHAT, add_generation_prompt=False)
    assert expected != reference(hf, CHAT, add_generation_prompt=True)
    with Client(server.target) as client:
        assert client.tokenize(messages=CHAT, add_generation_prompt=False) == expected
    chat = pb.ChatMessages(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT],
        add_generation_prompt=False,
    )
    assert generate_prompt_ids(server, pb.GenerateRequest(messages=chat)) == (len(expected), expected[1:])


@pytest.mark.parametrize("prefill", PREFILLS)
def test_continue_final_message_renders_as_transformers(server: ServerThread, hf, prefill: str) -> None:
    conversation = [*CHAT, {"role": "assistant", "content": prefill}]
    expected = reference(hf, conversation, add_generation_prompt=False, continue_final_message=True)
    assert hf.decode(expected).endswith(f"<|im_start|>assistant\n{prefill}")
    options = {"add_generation_prompt": False, "continue_final_message": True}
    with Client(server.target) as client:
        assert client.tokenize(messages=conversation, **options) == expected
    request = generate_request(messages=conversation, temperature=0.0, **options)
    assert generate_prompt_ids(server, request) == (len(expected), expected[1:])


def test_the_grpcurl_json_form_of_the_options(server: ServerThread, hf) -> None:
    """The JSON body grpcurl sends (docs/API.md): the kwargs as a JSON object, its whole numbers reaching
    the template as integers (a Struct holds them as doubles)."""
    body = (
        '{"messages":{"messages":[{"role":"system","content":"Be brief."},'
        '{"role":"user","content":"What is 2+2?"}],'
        '"chat_template_kwargs":{"enable_thinking":false,"thinking_budget":512}},'
        '"sampling_params":{"temperature":0}}'
    )
    request = json_format.Parse(body, pb.GenerateRequest())
    expected = reference(hf, CHAT, add_generation_prompt=True, enable_thinking=False, thinking_budget=512)
    assert "at most 512 tokens" in hf.decode(expected)
    assert generate_prompt_ids(server, request) == (len(expected), expected[1:])


# What Sluice passes the template: its variables, the special tokens, the environment's functions.
RESERVED = [
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "raise_exception",
]
PREFILLED = [*CHAT, {"role": "assistant", "content": "The answer is"}]
RESERVED_NAME = "is a name Sluice passes the chat template itself; it cannot be set"
BOTH = "cannot be combined with add_generation_prompt: set add_generation_prompt to false"
NOT_ASSISTANT = "the last message (messages[1]) must be an assistant message, got role 'user'"
CONTINUE = "continue_final_message"
# (options, conversation, the field refused, its message)
REFUSED = [
    *(
        ({"chat_template_kwargs": {"enable_thinking": False, name: "x"}}, CHAT,
         f"chat_template_kwargs.{name}", RESERVED_NAME)
        for name in RESERVED
    ),
    ({CONTINUE: True}, PREFILLED, CONTINUE, BOTH),  # add_generation_prompt unset: true
    ({CONTINUE: True, "add_generation_prompt": True}, PREFILLED, CONTINUE, BOTH),
    ({CONTINUE: True, "add_generation_prompt": False}, CHAT, CONTINUE, NOT_ASSISTANT),
]  # fmt: skip


# A Struct holds NaN and infinities, JSON (vLLM's request body) no such number: refused over gRPC.
NOT_JSON = [
    ({"chat_template_kwargs": {"enable_thinking": False, "budget": value}}, CHAT,
     "chat_template_kwargs.budget", "holds NaN or an infinity, which JSON has no number for")
    for value in (math.nan, -math.inf, [1, math.inf])
]  # fmt: skip


@pytest.mark.parametrize(("options", "conversation", "field", "message"), REFUSED + NOT_JSON)
def test_refusals_are_invalid_argument_naming_the_field(
    server: ServerThread, options: dict, conversation: list[dict], field: str, message: str
) -> None:
    generate = generate_request(messages=conversation, max_tokens=1, **options)
    tokenize = pb.TokenizeRequest(messages=generate.messages)
    with server.channel() as channel:
        stub = server.stub(channel)
        with pytest.raises(grpc.RpcError) as generated:
            list(stub.Generate(generate, timeout=60))
        with pytest.raises(grpc.RpcError) as tokenized:
            stub.Tokenize(tokenize, timeout=60)
    for info in (generated, tokenized):
        details = f"{field}: {message}"
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, details)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), num_blocks=64, attention_backend="torch")


def test_offline_chat_takes_the_options_as_vllm_names_them(llm: LLM, hf) -> None:
    kwargs = {"enable_thinking": False, "thinking_budget": 512}
    conversation = [*CHAT, {"role": "assistant", "content": "end", "reasoning_content": "2 and 2 make 4."}]
    params = SamplingParams(max_tokens=1)
    cases = [
        ({"chat_template_kwargs": kwargs}, CHAT, reference(hf, CHAT, add_generation_prompt=True, **kwargs)),
        ({"add_generation_prompt": False}, CHAT, reference(hf, CHAT, add_generation_prompt=False)),
        (
            {"add_generation_prompt": False, "continue_final_message": True},
            conversation,
            reference(hf, conversation, add_generation_prompt=False, continue_final_message=True),
        ),
    ]
    for options, messages, expected in cases:
        (completion,) = llm.chat(messages=[messages], sampling_params=params, **options)
        assert completion.prompt_token_ids == expected, options
    assert "<think>\n2 and 2 make 4.\n</think>\n\nend" in hf.decode(cases[2][2])


def test_a_message_whose_content_is_none_renders_as_empty_offline_as_over_grpc(
    llm: LLM, server: ServerThread, hf
) -> None:
    """vLLM renders content None as "", and so does the server (a ChatMessage's content is "" when
    unset); offline, the template (which reads every message's content) failed on it."""
    conversation = [*CHAT, {"role": "assistant", "content": None}, {"role": "user", "content": "And 3+3?"}]
    expected = reference(
        hf, [*CHAT, {**conversation[2], "content": ""}, conversation[3]], add_generation_prompt=True
    )
    (completion,) = llm.chat([conversation], SamplingParams(max_tokens=1))
    assert completion.prompt_token_ids == expected
    with Client(server.target) as client:
        assert client.tokenize(messages=conversation) == expected


@pytest.mark.parametrize(("options", "conversation", "field", "message"), REFUSED)
def test_offline_chat_refuses_naming_the_field(llm: LLM, options: dict, conversation, field, message) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.chat([conversation], SamplingParams(max_tokens=1), **options)
    assert (info.value.field, str(info.value)) == (field, f"{field}: {message}")


def test_a_template_that_drops_the_final_message_cannot_continue_it(model_dir: Path, hf) -> None:
    """A template that leaves out assistant content: no prompt ends inside it (transformers refuses too)."""
    no_assistant_content = (
        "{% for message in messages %}<|im_start|>{{ message.role }}\n"
        "{% if message.role != 'assistant' %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    )
    conversation = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    with pytest.raises(ValueError, match="final message does not appear"):
        hf.apply_chat_template(
            conversation, chat_template=no_assistant_content, tokenize=False, continue_final_message=True
        )
    ours = Tokenizer.from_pretrained(model_dir)
    ours.chat_template = ChatTemplate(no_assistant_content)
    with pytest.raises(InvalidRequestError) as info:
        ours.apply_chat_template(conversation, add_generation_prompt=False, continue_final_message=True)
    assert str(info.value) == (
        "continue_final_message: the last message's content does not appear in the chat template's render, "
        "so the prompt cannot end inside it"
    )


@pytest.mark.parametrize("prefill", ["The answer is ", "The answer is", "  Sure,\n"])
def test_a_template_that_trims_the_final_message_is_continued_as_transformers_cuts_it(
    model_dir: Path, hf, prefill: str
) -> None:
    """Where the template trimmed the spacing after the content, the prompt ends at the content less its
    trailing spacing (transformers' "more cautious" cut), not inside the tag."""
    trims = (
        "{% for message in messages %}<|im_start|>{{ message.role }}\n"
        "{{ message.content | trim }}<|im_end|>\n{% endfor %}"
    )
    conversation = [*CHAT, {"role": "assistant", "content": prefill}]
    expected = hf.apply_chat_template(
        conversation, chat_template=trims, tokenize=False, continue_final_message=True
    )
    assert expected.endswith(f"<|im_start|>assistant\n{prefill.strip()}")
    ours = Tokenizer.from_pretrained(model_dir)
    ours.chat_template = ChatTemplate(trims)
    assert (
        ours.apply_chat_template(conversation, add_generation_prompt=False, continue_final_message=True)
        == expected
    )


def test_a_final_message_without_text_cannot_be_continued(model_dir: Path, hf) -> None:
    conversation = [*CHAT, {"role": "assistant", "content": None}]
    with pytest.raises(ValueError, match='the final message has no "content" to continue'):
        hf.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
    ours = Tokenizer.from_pretrained(model_dir)
    with pytest.raises(InvalidRequestError) as info:
        ours.apply_chat_template(conversation, add_generation_prompt=False, continue_final_message=True)
    assert str(info.value) == (
        "continue_final_message: the last message (messages[2]) has no text content to continue"
    )


def test_a_chat_its_template_renders_to_nothing_is_refused_naming_messages(model_dir: Path) -> None:
    """Qwen3-style templates render nothing for a role they do not know ("developer" here) and no
    generation prompt when asked for none: such a chat reached the engine core with no prompt tokens,
    and the core process died of it, failing every request in flight."""
    skips_unknown_roles = (
        "{% for message in messages %}{% if message.role in ('system', 'user', 'assistant') %}"
        "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    ours = Tokenizer.from_pretrained(model_dir)
    ours.chat_template = ChatTemplate(skips_unknown_roles)
    developer = [{"role": "developer", "content": "Be brief."}]
    assert resolve_prompt(ours, messages=developer)  # the generation prompt alone
    with pytest.raises(InvalidRequestError) as info:
        resolve_prompt(
            ours, messages=developer, chat_options=ChatTemplateOptions(add_generation_prompt=False)
        )
    assert str(info.value) == "messages: the chat template renders them to no tokens"


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ("{% macro deep(n) %}{{ deep(n + 1) }}{% endmacro %}{{ deep(0) }}", "maximum recursion depth"),
        ("{% for i in range(200000) %}{% endfor %}", "Range too big"),
        ("{{ 1 // 0 }}", "by zero"),
        ("{{ '{:d}'.format('x') }}", "Unknown format code 'd'"),
    ],
)
def test_a_render_that_fails_is_invalid_argument_not_an_internal_error(
    model_dir: Path, template: str, error: str
) -> None:
    """A template's recursion (gpt-oss's render_typescript_type over a deeply nested tool schema), the
    sandbox's range limit, an arithmetic error: INTERNAL (and a logged traceback) for what the caller sent."""
    ours = Tokenizer.from_pretrained(model_dir)
    ours.chat_template = ChatTemplate(template)
    with pytest.raises(InvalidRequestError) as info:
        resolve_prompt(ours, messages=CHAT)
    assert info.value.field == "messages" and "chat template failed: " in str(info.value)
    assert error in str(info.value)
