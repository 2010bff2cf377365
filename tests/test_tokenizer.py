"""Tokenizer and chat templates against transformers' AutoTokenizer on the same directories."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import sentencepiece
import tokenizers
from tokenizer_fixtures import build_byte_level_bpe, build_sentencepiece_llama
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from sluice.engine.errors import InvalidRequestError
from sluice.engine.text.tokenizer import Tokenizer

TEXTS = [
    "Hello world!",
    " leading space and  double  spaces",
    "Café naïve résumé Straße",
    "你好，世界。",
    "Emoji 😀🚀 👍🏽 ❤️ 🇫🇷",
    "line one\nline two\n\n\tindented",
    "",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "<s>[INST] hi [/INST] ok</s>",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [
        {"role": "system", "content": "Réponds en français."},
        {"role": "user", "content": "Bonjour 😀"},
        {"role": "assistant", "content": "Salut !"},
        {"role": "user", "content": "你好"},
    ],
    [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}],
]


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "bpe": build_byte_level_bpe(root / "bpe"),
        "sentencepiece": build_sentencepiece_llama(root / "sp"),
    }


@pytest.fixture(scope="module", params=["bpe", "sentencepiece"])
def pair(request: pytest.FixtureRequest, tokenizer_dirs: dict[str, Path]):
    directory = tokenizer_dirs[request.param]
    return Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pair, add_special_tokens: bool) -> None:
    ours, hf = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == hf.encode(
            text, add_special_tokens=add_special_tokens
        ), text


def test_truncation_or_padding_saved_in_the_file_is_not_applied(tokenizer_dirs, tmp_path: Path) -> None:
    """A tokenizer.json saved with truncation (some checkpoints ship max_length 2048) cut every prompt to
    it, and with fixed padding padded every one; transformers turns both off as it loads."""
    directory = tmp_path / "saved-mid-training"
    shutil.copytree(tokenizer_dirs["bpe"], directory)
    saved = json.loads((directory / "tokenizer.json").read_text())
    saved["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    saved["padding"] = {
        "strategy": {"Fixed": 40},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 4,
        "pad_type_id": 0,
        "pad_token": "<pad>",
    }
    (directory / "tokenizer.json").write_text(json.dumps(saved))
    ours, hf = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    text = TEXTS[1]
    assert 4 < len(hf.encode(text)) < 40
    assert ours.encode(text) == hf.encode(text) == Tokenizer.from_spec(ours.spec()).encode(text)
    assert json.loads(ours.spec().tokenizer_json)["truncation"] is None  # nor in what SMG gets


def test_add_special_tokens_prepends_bos(pair) -> None:
    ours, _ = pair
    assert ours.encode("Hello", add_special_tokens=True)[0] == ours.bos_token_id
    assert ours.encode("Hello", add_special_tokens=False)[0] != ours.bos_token_id


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(pair, skip_special_tokens: bool) -> None:
    ours, hf = pair
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=True)
        expected = hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected, text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(pair, add_generation_prompt: bool) -> None:
    ours, hf = pair
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.apply_chat_template(messages, add_generation_prompt) == expected
        expected_ids = hf.apply_chat_template(
            messages, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.encode_chat(messages, add_generation_prompt) == expected_ids


def test_chatml_render_is_exact(tokenizer_dirs: dict[str, Path]) -> None:
    ours = Tokenizer.from_pretrained(tokenizer_dirs["bpe"])
    text = ours.apply_chat_template([{"role": "user", "content": "  Hi  "}], add_generation_prompt=True)
    assert text == "<|bos|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_special_ids_and_sizes(pair) -> None:
    ours, hf = pair
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.vocab_size == len(hf)
    assert ours.token_to_id(hf.eos_token) == hf.eos_token_id
    assert ours.id_to_token(hf.eos_token_id) == hf.eos_token


def test_eos_ids_merge_generation_config(tokenizer_dirs: dict[str, Path]) -> None:
    bpe = Tokenizer.from_pretrained(tokenizer_dirs["bpe"])
    eos, im_end = bpe.token_to_id("<|eos|>"), bpe.token_to_id("<|im_end|>")
    assert bpe.eos_token_ids == (eos, im_end)
    assert Tokenizer.from_pretrained(tokenizer_dirs["sentencepiece"]).eos_token_ids == (2,)


def test_sentencepiece_encode_matches_sentencepiece_library(tokenizer_dirs: dict[str, Path]) -> None:
    ours = Tokenizer.from_pretrained(tokenizer_dirs["sentencepiece"])
    model = Path(tokenizer_dirs["sentencepiece"]).parent / "source" / "tokenizer.model"
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    for text in ["Hello world!", "Café naïve résumé Straße", "你好，世界。", "Emoji 😀🚀 👍🏽"]:
        assert ours.encode(text) == [processor.bos_id(), *processor.encode(text)], text
        assert ours.decode(ours.encode(text)) == processor.decode(processor.encode(text))


def test_raise_exception_becomes_invalid_request(tokenizer_dirs: dict[str, Path]) -> None:
    ours = Tokenizer.from_pretrained(tokenizer_dirs["sentencepiece"])
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidRequestError, match="roles must alternate") as info:
        ours.apply_chat_template(messages)
    assert info.value.field == "messages"
    with pytest.raises(InvalidRequestError, match="at least one message"):
        ours.encode_chat([])


def test_no_chat_template_is_invalid_request(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    directory = tmp_path / "plain"
    shutil.copytree(tokenizer_dirs["bpe"], directory)
    (directory / "chat_template.jinja").unlink()
    ours = Tokenizer.from_pretrained(directory)
    assert ours.encode("Hello") == AutoTokenizer.from_pretrained(directory).encode("Hello")
    with pytest.raises(InvalidRequestError) as info:
        ours.encode_chat([{"role": "user", "content": "hi"}])
    assert info.value.field == "messages"


def test_a_chat_template_that_is_no_jinja_is_refused_at_load_naming_it(
    tokenizer_dirs, tmp_path: Path
) -> None:
    directory = tmp_path / "broken"
    shutil.copytree(tokenizer_dirs["bpe"], directory)
    (directory / "chat_template.jinja").write_text("{% for message in messages %}{{ message.content }}")
    with pytest.raises(ValueError) as info:
        Tokenizer.from_pretrained(directory)
    assert str(info.value).startswith("chat_template: invalid jinja2 template: Unexpected end of template.")


FEATURE_TEMPLATE = (
    "{% set ns = namespace(count=0) %}"
    "{% for message in messages %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}"
    "{% if message['role'] == 'system' %}{% continue %}{% endif %}"
    "{% set ns.count = ns.count + 1 %}"
    "{% generation %}{{ message | tojson }}{% endgeneration %}\n"
    "{{ dict(role=message['role']) | tojson(indent=2) }}\n"
    "{% endfor %}"
    "count={{ ns.count }} year={{ strftime_now('%Y') }} pad={{ pad_token }} unk={{ unk_token }}"
)


def test_config_variants_and_template_features(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    # Special tokens as {"content": ...} dicts, chat_template as a list of named templates in the config,
    # no chat_template.jinja: the shape older transformers versions and many Hub repos use.
    directory = tmp_path / "variant"
    shutil.copytree(tokenizer_dirs["bpe"], directory)
    (directory / "chat_template.jinja").unlink()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "special": True}
    config["chat_template"] = [
        {"name": "default", "template": FEATURE_TEMPLATE},
        {"name": "tool_use", "template": "tools"},
    ]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    messages = [
        {"role": "system", "content": "skipped"},
        {"role": "user", "content": "<b>café</b> 😀", "name": None},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "cut by break"},
    ]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert '{"role": "user", "content": "<b>café</b> 😀"}' in expected
    assert ours.eos_token_ids[0] == ours.token_to_id("<|im_end|>") == hf.eos_token_id


def test_add_bos_token_installs_post_processor(tokenizer_dirs: dict[str, Path]) -> None:
    # A GGUF vocabulary arrives without a post-processor; transformers' add_bos_token=True is the reference.
    def bare_backend() -> tokenizers.Tokenizer:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_dirs["bpe"] / "tokenizer.json"))
        backend.post_processor = None
        return backend

    ours = Tokenizer(
        bare_backend(),
        chat_template=None,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        eos_token_ids=(),
        add_bos_token=True,
        name="gguf",
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=bare_backend(), bos_token="<|bos|>", eos_token="<|eos|>", add_bos_token=True
    )
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert ours.eos_token_ids == (ours.token_to_id("<|eos|>"),)


def test_encode_lets_other_threads_run_while_it_tokenizes(pair) -> None:
    """The frontend tokenizes a long prompt in a worker thread: were the GIL held throughout, its event loop
    (every stream) would still stop until the prompt was done. The main thread notes the time every
    millisecond or so while a worker encodes; some notes must fall in the middle half of the encode (with
    the GIL held, the main thread runs only before the call and once it returns)."""
    tokenizer, _ = pair
    text = "Café naïve résumé, the quick brown fox. " * 25_000  # 1,000,000 characters
    span: list[float] = []

    def work() -> None:
        span.append(time.perf_counter())
        tokenizer.encode(text)
        span.append(time.perf_counter())

    notes = [time.perf_counter()]
    worker = threading.Thread(target=work)
    worker.start()
    while worker.is_alive():
        now = time.perf_counter()
        if now - notes[-1] > 0.001:
            notes.append(now)
    worker.join()
    start, end = span
    quarter = (end - start) / 4
    assert any(start + quarter < t < end - quarter for t in notes)
