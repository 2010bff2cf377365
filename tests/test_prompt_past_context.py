"""A text prompt far past the model's context is refused from a prefix, without being tokenized whole: a
60 MB prompt took the frontend 127 s and 3.7 GB to be refused. The prefix may refuse only what the whole
would: checked on real tokenizers (SmolLM2's byte-level BPE, Gemma 3's SentencePiece BPE, the tiny
Llama's) over seeded texts, including ones that pack many characters into a token."""

from __future__ import annotations

import random

import grpc
import pytest
from checkpoints import LONG_CONTEXT
from service_harness import ServerThread
from smg_grpc_proto import vllm_engine_pb2 as smg

from sluice import Client, SluiceError, generate_request
from sluice.engine.errors import ContextLengthError, InvalidRequestError
from sluice.engine.loading.default_model import default_model_path
from sluice.engine.loading.gguf_file import GGUFFile
from sluice.engine.loading.gguf_tokenizer import gguf_tokenizer
from sluice.engine.loading.packaged_models import packaged_model_path
from sluice.engine.model_info import ModelInfo
from sluice.engine.text.tokenizer import PREFIX_CHARS_PER_TOKEN, Tokenizer
from sluice.service import smg_convert

pytestmark = pytest.mark.timeout(300)

# Pieces of the seeded texts: words, accents and combining marks, CJK without spaces, emoji, digits, and
# runs (of spaces, '=', '-', newlines) that tokenizers pack many to a token.
PIECES = (
    "word ",
    "naïve café ",
    "e\u0301 ",
    "東京都渋谷区の",
    "🙂👍🏽",
    "1234567890",
    " " * 48,
    "=" * 40,
    "-" * 64,
    "\n\n",
    "\t",
    "aaaaaaaaaaaaaaaa",
    "def f(x):\n    return x ** 2\n",
)


class _Recording:
    """A tokenizer's backend that records the length of every text it encodes."""

    def __init__(self, backend: object) -> None:
        self._backend = backend
        self.lengths: list[int] = []

    def encode_batch(self, texts: list[str], **kwargs: object) -> object:
        self.lengths += [len(text) for text in texts]
        return self._backend.encode_batch(texts, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self._backend, name)


def _recording(tokenizer: Tokenizer) -> _Recording:
    tokenizer.backend = recording = _Recording(tokenizer.backend)
    return recording


def _packaged_tokenizer(name: str) -> Tokenizer:
    return gguf_tokenizer(GGUFFile(default_model_path() if name == "smollm2" else packaged_model_path(name)))


@pytest.fixture(scope="module", params=["smollm2", "gemma3-270m", "tiny-llama"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "tiny-llama":
        return Tokenizer.from_pretrained(request.getfixturevalue("llama_dir"))
    return _packaged_tokenizer(request.param)


def _text(rng: random.Random, num_pieces: int) -> str:
    return "".join(rng.choice(PIECES) * rng.randint(1, 40) for _ in range(num_pieces))


def test_a_text_far_past_the_context_is_refused_from_a_prefix(tokenizer: Tokenizer) -> None:
    text = _text(random.Random(7), 6000)  # ~1 MB
    context = 2048
    recording = _recording(tokenizer)
    with pytest.raises(ContextLengthError) as refused:
        tokenizer.encode(text, context=context)
    assert refused.value.field == "prompt"
    assert "characters alone are" in str(refused.value)
    assert f"past the model's context of {context:,} tokens" in str(refused.value)
    assert max(recording.lengths) <= 4 * PREFIX_CHARS_PER_TOKEN * context < len(text) // 4
    # A chat prompt's render, the same way.
    if tokenizer.chat_template is not None:
        with pytest.raises(ContextLengthError, match=r"^prompt: its first "):
            tokenizer.encode_chat([{"role": "user", "content": text}], context=context)


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_a_prefix_refuses_only_what_the_whole_text_would(name: str) -> None:
    """Every seeded text at contexts around its token count and below its characters per token: refused
    only where its tokens are `context` or more; otherwise encoded exactly as without a context. Some
    texts fit a context they are over 16 characters a token of (the real vocabularies hold long runs):
    they go through the prefixes and are encoded whole."""
    tokenizer = _packaged_tokenizer(name)
    rng = random.Random(11)
    refused = encoded_through_prefixes = 0
    for _ in range(60):
        text = _text(rng, rng.randint(1, 60))
        ids = tokenizer.encode(text)
        contexts = {len(ids) - 3, len(ids), len(ids) + 1, len(ids) + 9, len(text) // 17, len(text) // 64}
        for context in sorted(c for c in contexts if c >= 1):
            try:
                got = tokenizer.encode(text, context=context)
            except ContextLengthError:
                assert len(ids) >= context, (text, context, len(ids))
                refused += 1
                continue
            assert got == ids
            encoded_through_prefixes += len(text) > PREFIX_CHARS_PER_TOKEN * context
    assert refused > 0 and encoded_through_prefixes > 0, (refused, encoded_through_prefixes)


def test_a_prompt_far_past_the_context_is_refused_over_grpc_and_a_truncated_one_served(
    server: ServerThread,
) -> None:
    """RESOURCE_EXHAUSTED naming the prompt, as the whole's refusal; with truncate_prompt_tokens the whole
    text is tokenized and its last tokens served."""
    text = "word " * (2 * PREFIX_CHARS_PER_TOKEN * LONG_CONTEXT // 5 + 1000)  # the first prefix under half
    with Client(server.target) as client:
        with pytest.raises(SluiceError) as refused:
            client.complete(generate_request(text, max_tokens=2))
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.message.startswith("prompt: its first "), refused.value.message
        served = client.complete(generate_request(text, max_tokens=2, truncate_prompt_tokens=8))
        assert served.usage.prompt_tokens == 8
    server.wait_idle()


def test_smg_refuses_a_text_far_past_the_context_naming_text(llama_dir: str) -> None:
    """SMG's text prompt (SMG itself sends token ids): INVALID_ARGUMENT naming `text`, vLLM's 400, from a
    prefix; with truncate_prompt_tokens, its last tokens."""
    tokenizer = Tokenizer.from_pretrained(llama_dir)
    info = ModelInfo(
        name="tiny", architecture="LlamaForCausalLM", max_model_len=64, vocab_size=tokenizer.vocab_size,
        eos_token_ids=(1,), block_size=16, num_kv_blocks=64,
    )  # fmt: skip
    text = "word " * 20_000
    recording = _recording(tokenizer)
    with pytest.raises(InvalidRequestError) as refused:
        smg_convert.generation_spec_from_smg(smg.GenerateRequest(text=text), info, tokenizer)
    assert not isinstance(refused.value, ContextLengthError)  # INVALID_ARGUMENT: SMG retries the other
    assert refused.value.field == "text" and "characters alone are" in str(refused.value)
    assert max(recording.lengths) < len(text) // 4
    truncated = smg.GenerateRequest(text=text, sampling_params=smg.SamplingParams(truncate_prompt_tokens=5))
    spec = smg_convert.generation_spec_from_smg(truncated, info, tokenizer)
    assert list(spec.prompt.token_ids) == tokenizer.encode(text)[-5:]
