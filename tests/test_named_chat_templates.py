"""Named chat templates: a model may ship a "tool_use" template beside its default one (Hermes 2 Pro,
Command R). transformers' `get_chat_template` renders a request with tools by "tool_use" where there is
one (else by the default), and reads the templates from `chat_template.jinja` and
`additional_chat_templates/*.jinja` (as it saves them) or from a list of {"name", "template"} in
`tokenizer_config.json`; llama.cpp does the same with a GGUF's `tokenizer.chat_template.tool_use`. Sluice
must render what they render: through the Tokenizer, through the spec the frontend process is built from,
through `LLM.chat` and through a real server's Tokenize.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from gguf import GGUFWriter
from gguf_export import _write_vocabulary as write_vocabulary
from service_harness import ServerThread, tiny_engine_config
from tokenizer_fixtures import build_byte_level_bpe
from transformers import AutoTokenizer

from sluice import Client
from sluice.engine.frontend.llm import LLM
from sluice.engine.loading.gguf_file import GGUFFile
from sluice.engine.loading.gguf_tokenizer import gguf_tokenizer
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.tool_calls import Tool, ToolUse
from sluice.engine.text.tokenizer import Tokenizer

DEFAULT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_USE = "<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n" + DEFAULT
WEATHER = ToolUse((Tool("get_weather", "Weather in a city", '{"type": "object", "properties": {}}'),))
TOOLS = WEATHER.for_template()
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


def _with_config_list(directory: Path) -> Path:
    """The templates as older transformers saved them: a list in tokenizer_config.json."""
    (directory / "chat_template.jinja").unlink()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": DEFAULT},
        {"name": "tool_use", "template": TOOL_USE},
    ]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("named")
    config_list = _with_config_list(build_byte_level_bpe(root / "config_list"))
    saved = root / "saved"  # transformers' own layout: chat_template.jinja + additional_chat_templates/
    AutoTokenizer.from_pretrained(config_list).save_pretrained(saved)
    assert (saved / "additional_chat_templates" / "tool_use.jinja").read_text() == TOOL_USE
    return {"config_list": config_list, "saved": saved}


@pytest.mark.parametrize("layout", ["config_list", "saved"])
@pytest.mark.parametrize("tools", [TOOLS, None])
def test_renders_as_transformers(layouts: dict[str, Path], layout: str, tools: list | None) -> None:
    hf = AutoTokenizer.from_pretrained(layouts[layout])
    ours = Tokenizer.from_pretrained(layouts[layout])
    expected = hf.apply_chat_template(MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True)
    assert expected.startswith("<|im_start|>system\nTools: [") == (tools is not None)
    expected_ids = hf.apply_chat_template(
        MESSAGES, tools=tools, add_generation_prompt=True, return_dict=False
    )
    for tokenizer in (ours, Tokenizer.from_spec(ours.spec())):  # the frontend process's copy
        assert tokenizer.apply_chat_template(MESSAGES, tools=tools) == expected
        assert tokenizer.encode_chat(MESSAGES, tools=tools) == expected_ids


def test_gguf_tool_use_template(llama_dir: str, tmp_path: Path) -> None:
    # gguf-py's writer stores a checkpoint's named templates as tokenizer.chat_template.<name>; llama.cpp
    # (common/chat.cpp) renders a request with tools by "tool_use".
    with open(Path(llama_dir) / "config.json") as f:
        config = json.load(f)
    path = str(tmp_path / "vocabulary.gguf")
    writer = GGUFWriter(path, "llama")
    write_vocabulary(writer, llama_dir, config)
    writer.add_chat_template(
        [{"name": "default", "template": DEFAULT}, {"name": "tool_use", "template": TOOL_USE}]
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert GGUFFile(path).metadata["tokenizer.chat_template.tool_use"] == TOOL_USE
    ours = gguf_tokenizer(GGUFFile(path))
    hf = AutoTokenizer.from_pretrained(llama_dir)
    for tools, template in ((TOOLS, TOOL_USE), (None, DEFAULT)):
        expected = hf.apply_chat_template(
            MESSAGES, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        assert ours.apply_chat_template(MESSAGES, tools=tools) == expected
        assert Tokenizer.from_spec(ours.spec()).apply_chat_template(MESSAGES, tools=tools) == expected


@pytest.fixture(scope="module")
def model_dir(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a default and a tool_use template, in transformers' layout."""
    directory = tmp_path_factory.mktemp("named_model") / "llama"
    shutil.copytree(llama_dir, directory)
    (directory / "chat_template.jinja").write_text(DEFAULT)
    (directory / "additional_chat_templates").mkdir()
    (directory / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE)
    return directory


def test_grpc_tokenize_with_tools_uses_the_tool_use_template(model_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(model_dir)
    server = ServerThread(tiny_engine_config(str(model_dir))).start()
    try:
        with Client(server.target) as client:
            for tools in (TOOLS, None):
                expected = hf.apply_chat_template(
                    MESSAGES, tools=tools, add_generation_prompt=True, return_dict=False
                )
                assert client.tokenize(messages=MESSAGES, tools=tools) == expected
    finally:
        server.stop()


def test_llm_chat_with_tools_prompts_with_the_tool_use_template(model_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(str(model_dir), block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for tool_use, tools in ((WEATHER, TOOLS), (None, None)):
        expected = hf.apply_chat_template(
            MESSAGES, tools=tools, add_generation_prompt=True, return_dict=False
        )
        (completion,) = llm.chat(MESSAGES, params, tool_use=tool_use)
        assert completion.prompt_token_ids == expected
