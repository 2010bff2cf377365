"""A GGUF special token id past the vocabulary is ignored, as llama.cpp ignores it when it loads the
vocabulary (src/llama-vocab.cpp logs "bad special token: 'tokenizer.ggml.padding_token_id' = 4294967295,
using default id -1"). Files carry 4294967295 (-1 written unsigned) for a padding or separator token the
model does not have, llama.cpp's own test models among them; Sluice refused such a SentencePiece file with
an IndexError ("list index out of range") naming nothing, and listed an out-of-range eot id among the
end-of-generation ids.

The vocabulary is mistral-common's SentencePiece model (Mistral 7B v0.1), written as llama.cpp's converter
writes it; the reference encoding is the `sentencepiece` library's on that model.
"""

from __future__ import annotations

import logging
from pathlib import Path

import mistral_common
import pytest
import sentencepiece as spm
from test_gguf_sentencepiece import write_sentencepiece_gguf

from sluice.engine.loading.gguf_file import GGUFFile
from sluice.engine.loading.gguf_tokenizer import gguf_tokenizer

SPM_MODEL = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
NO_TOKEN = 4294967295
TEXTS = ["Hello, world!", "東京タワー 🙂 Привет мир", "def f(x):\n    return x ** 2"]


def _write(path: Path, token_ids: dict[str, int]) -> str:
    write_sentencepiece_gguf(str(path), str(SPM_MODEL), "llama", token_ids=token_ids)
    return str(path)


@pytest.fixture(scope="module")
def sp() -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(SPM_MODEL))


@pytest.mark.parametrize("name", ["padding", "seperator", "eot", "eom"])
def test_a_special_id_past_the_vocabulary_is_ignored(
    sp: spm.SentencePieceProcessor, tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    path = _write(tmp_path / f"{name}.gguf", {name: NO_TOKEN})
    with caplog.at_level(logging.WARNING, logger="sluice.engine.loading.gguf_tokenizer"):
        tokenizer = gguf_tokenizer(GGUFFile(path))
    assert caplog.messages == [
        f"GGUF tokenizer.ggml.{name}_token_id = {NO_TOKEN} is no token of the 32000-token vocabulary; ignored"
    ]
    assert tokenizer.eos_token_ids == (sp.eos_id(),)
    assert tokenizer.bos_token_id == sp.bos_id()
    for text in TEXTS:
        assert tokenizer.encode(text) == [sp.bos_id(), *sp.encode(text)]
        assert tokenizer.decode(sp.encode(text)) == sp.decode(sp.encode(text))


def test_special_ids_in_the_vocabulary_are_kept(sp: spm.SentencePieceProcessor, tmp_path: Path) -> None:
    path = _write(tmp_path / "in_range.gguf", {"padding": sp.unk_id(), "eot": sp.eos_id() + 1})
    tokenizer = gguf_tokenizer(GGUFFile(path))
    assert tokenizer.eos_token_ids == (sp.eos_id(), sp.eos_id() + 1)
    assert tokenizer.encode("Hello") == [sp.bos_id(), *sp.encode("Hello")]
