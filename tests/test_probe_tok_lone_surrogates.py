"""A lone surrogate in a prompt is the caller's error, named: `tokenizers` cannot encode it (no UTF-8 text
holds one) and raised a TypeError naming no cause, which the server answered INTERNAL. Over gRPC a tool's
JSON schema brings one in (the escape "\\ud83d" parses to it) and a template prints the tools; through
`LLM` a text prompt or a message's content may hold one.
"""

from __future__ import annotations

import grpc
import pytest

from sluice.engine.errors import InvalidRequestError
from sluice.engine.loading.default_model import default_model_path
from sluice.engine.loading.gguf_file import GGUFFile
from sluice.engine.loading.gguf_tokenizer import gguf_tokenizer
from sluice.engine.structured.tool_calls import Tool
from sluice.engine.text.chat_template import ChatTemplate
from sluice.engine.text.prompt import resolve_prompt
from sluice.engine.text.tokenizer import Tokenizer
from sluice.service.status import status_for

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
MESSAGES = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tokenizer = gguf_tokenizer(GGUFFile(default_model_path()))
    tokenizer.chat_template = ChatTemplate(TOOLS_TEMPLATE)
    return tokenizer


def test_a_tool_schema_holding_a_lone_surrogate_is_refused_naming_tools(tokenizer: Tokenizer) -> None:
    schema = '{"type": "object", "properties": {"city": {"type": "string", "description": "\\ud83d"}}}'
    tool = Tool("get_weather", "Weather now", schema)
    with pytest.raises(InvalidRequestError) as error:
        resolve_prompt(tokenizer, messages=MESSAGES, tools=[tool.for_template()])
    assert error.value.field == "tools"
    assert str(error.value) == (
        "tools: holds a lone surrogate (\\ud83d), which a prompt's UTF-8 text cannot hold"
    )
    assert status_for(error.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
    # The same schema with the surrogate pair whole is an emoji, rendered and encoded.
    whole = Tool("get_weather", "Weather now", schema.replace("\\ud83d", "\\ud83d\\ude00"))
    ids = resolve_prompt(tokenizer, messages=MESSAGES, tools=[whole.for_template()])
    assert "\U0001f600" in tokenizer.decode(ids)


def test_a_lone_surrogate_in_a_message_or_a_text_prompt_is_refused_naming_it(tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError) as error:
        resolve_prompt(tokenizer, messages=[{"role": "user", "content": "hi \udc00 there"}])
    assert str(error.value) == (
        "messages: holds a lone surrogate (\\udc00), which a prompt's UTF-8 text cannot hold"
    )
    with pytest.raises(InvalidRequestError) as error:
        resolve_prompt(tokenizer, text="a\ud83db")
    assert (
        str(error.value) == "text: holds a lone surrogate (\\ud83d), which a prompt's UTF-8 text cannot hold"
    )
    assert tokenizer.encode("a\U0001f600b", add_special_tokens=False) == tokenizer.encode(
        "a\ud83d\ude00b".encode("utf-16", "surrogatepass").decode("utf-16"), add_special_tokens=False
    )
