"""An assistant message's reasoning reaches the chat template under every name templates read it by, as
transformers passes it: "reasoning_content" (Qwen3, DeepSeek R1 templates), "thinking" (gpt-oss) and
"reasoning" (what vLLM's API sends now), whichever of them the caller used; over gRPC too (ChatMessage's
reasoning_content, which the Python client fills from any of the names)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizer_fixtures import build_byte_level_bpe
from transformers import AutoTokenizer

from sluice.chat_messages import chat_message
from sluice.engine.text.chat_template import ChatTemplate
from sluice.engine.text.tokenizer import Tokenizer
from sluice.service.convert import messages_from_proto
from sluice.v1 import sluice_pb2 as pb

# Prints each name's value, or "-" where the message has none.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for name in ['reasoning_content', 'thinking', 'reasoning'] %}"
    "{{ name }}={{ m[name] if m[name] is defined else '-' }};"
    "{% endfor %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    directory = build_byte_level_bpe(Path(tmp_path_factory.mktemp("bpe")))
    ours = Tokenizer.from_pretrained(directory)
    ours.chat_template = ChatTemplate(TEMPLATE)
    return ours, AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize(
    "reasoning",
    [
        {"reasoning": "add them"},
        {"thinking": "add them"},
        {"reasoning_content": "add them"},
        {"reasoning_content": None, "reasoning": "add them"},  # an OpenAI client's null field
        {"thinking": "add them", "reasoning": "vLLM's name, second to thinking"},
    ],
)
def test_reasoning_renders_as_transformers(pair, reasoning: dict) -> None:
    ours, hf = pair
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", **reasoning}]
    expected = hf.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False)
    assert "reasoning_content=add them;" in expected
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert messages[1] == {"role": "assistant", "content": "4", **reasoning}  # the caller's message unchanged
    # Through the Python client and the server's conversion (the client dropped it): one field carries the
    # first name's value, which renders as transformers renders it given as reasoning_content.
    sent = messages_from_proto(pb.ChatMessages(messages=[chat_message(m) for m in messages]))
    as_sent = [messages[0], {"role": "assistant", "content": "4", "reasoning_content": "add them"}]
    expected = hf.apply_chat_template(as_sent, chat_template=TEMPLATE, tokenize=False)
    assert ours.apply_chat_template(list(sent), add_generation_prompt=False) == expected
