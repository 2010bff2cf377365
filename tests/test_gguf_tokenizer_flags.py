"""The `tokenizer.ggml.*` keys of a GGUF file that change how text encodes, as llama.cpp reads them
(src/llama-vocab.cpp: `llama_vocab::impl::load`, `tokenize`, `detokenize`), GGUF's reference.

- `add_space_prefix` (SentencePiece vocabularies, llama.cpp's default true; its converter writes the
  SentencePiece model's `add_dummy_prefix`): one space before every stretch of text that starts the input or
  follows a special token, even one that starts with a space; none when false, and then decoding keeps a
  leading space. The reference is the `sentencepiece` library on each stretch, with and without the dummy
  prefix. transformers' GGUF tokenizer differs on both values: it ignores false, and true prefixes only the
  input's first stretch, and not one that starts with a space.
- `add_eos_token`: EOS after the text when special tokens are added; llama.cpp and transformers agree, and
  transformers is the reference.
- `pre` "default" (byte-level BPE; also a file that names no pre-tokenizer): llama.cpp's own regexes, not
  GPT-2's split that transformers uses; the expected pieces are spelled out from llama-vocab.cpp.

Checked and already as llama.cpp, so not here: `add_bos_token` (test_gguf_end_of_generation.py), and
`remove_extra_whitespaces`, which llama.cpp reads but applies to T5's (UGM) vocabularies only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from gguf import GGUFWriter, TokenType
from test_gguf_sentencepiece import CORPUS, write_sentencepiece_gguf
from tokenizers.pre_tokenizers import ByteLevel

from sluice.engine.loading.gguf_file import GGUFFile
from sluice.engine.loading.gguf_tokenizer import gguf_tokenizer
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.text.detokenizer import IncrementalDetokenizer
from sluice.engine.text.tokenizer import Tokenizer

PLAIN = [
    "Hello, world! the quick brown fox",
    " one leading space",
    "  two leading,  double  spaces and a trailing one ",
    "\ttab\nnew line; 東京タワー 🙂 Привет",
    "",
]
# The first is Llama 2's chat prompt, whose "[INST]" after <s> the model saw as "▁[INST]".
WITH_SPECIAL_TOKENS = ["<s>[INST] Hello [/INST]", "hello</s> world<s>again", "</s> "]


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, str]:
    """Dummy prefix -> a SentencePiece BPE model that keeps the text as typed (no NFKC, no collapsing of
    spaces: llama.cpp does neither) with or without it."""
    import sentencepiece as spm

    directory = tmp_path_factory.mktemp("spm_flags")
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    models = {}
    for prefix in (True, False):
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(directory / f"prefix_{prefix}"), vocab_size=600,
            model_type="bpe", byte_fallback=True, character_coverage=0.9995, minloglevel=2,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=prefix,
        )  # fmt: skip
        models[prefix] = str(directory / f"prefix_{prefix}.model")
    return models


def _sentencepiece_gguf(directory: Path, spm_model: str, flags: dict[str, bool]) -> str:
    path = directory / "llama.gguf"
    write_sentencepiece_gguf(str(path), spm_model, "llama", flags)
    return str(path)


def _by_stretches(sp, text: str) -> list[int]:
    """llama.cpp's ids for `text` with special tokens parsed: each special token's id, and each stretch of
    text between them as SentencePiece encodes it alone."""
    ids = []
    for part in re.split(r"(</?s>)", text):
        if part in ("<s>", "</s>"):
            ids.append(sp.piece_to_id(part))
        elif part:
            ids += sp.encode(part)
    return ids


@pytest.mark.parametrize("add_space_prefix", [True, False, None])
def test_space_prefix_as_llama_cpp(spm_models, tmp_path: Path, add_space_prefix: bool | None) -> None:
    import sentencepiece as spm

    prefixed = add_space_prefix is not False  # llama.cpp's default where the file has no key
    flags = {} if add_space_prefix is None else {"add_space_prefix": add_space_prefix}
    sp = spm.SentencePieceProcessor(model_file=spm_models[prefixed])
    ours = gguf_tokenizer(GGUFFile(_sentencepiece_gguf(tmp_path, spm_models[prefixed], flags)))
    for text in PLAIN:
        ids = sp.encode(text)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.encode(text) == [sp.bos_id(), *ids], text
        assert ours.decode(ids) == sp.decode(ids) == text
        assert ours.decode([sp.bos_id(), *ids]) == text
    for text in WITH_SPECIAL_TOKENS:
        assert ours.encode(text, add_special_tokens=False) == _by_stretches(sp, text), text
    first = ours.encode("<s>[INST]", add_special_tokens=False)[1]
    assert ours.id_to_token(first).startswith("\u2581") == prefixed


def test_stream_without_space_prefix_keeps_the_first_words_space(spm_models, tmp_path: Path) -> None:
    """The output's first "▁" is a space of the text, whether or not a prompt came before it."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=spm_models[False])
    path = _sentencepiece_gguf(tmp_path, spm_models[False], {"add_space_prefix": False})
    ours = gguf_tokenizer(GGUFFile(path))
    output = sp.encode(" the quick brown fox")
    assert ours.id_to_token(output[0]) == "\u2581the"
    for prompt in ([], sp.encode("Say:")):
        detokenizer = IncrementalDetokenizer(ours, SamplingParams(), prompt)
        streamed = "".join(detokenizer.add_tokens([token_id]) for token_id in output)
        assert streamed + detokenizer.flush() == " the quick brown fox", prompt


def _byte_level_gguf(path: Path, pre: str | None, pieces: list[str], flags: dict[str, bool]) -> str:
    """A byte-level BPE vocabulary only: the 256 byte symbols, <|begin_of_text|> (256), <|end_of_text|>
    (257), then `pieces`, each made by one merge, in their order (the merges' ranks)."""
    tokens = sorted(ByteLevel.alphabet()) + ["<|begin_of_text|>", "<|end_of_text|>", *pieces]
    merges = []
    for piece in pieces:  # each piece = the longest earlier token it starts with + its rest
        left = max((t for t in tokens[: tokens.index(piece)] if piece.startswith(t)), key=len)
        merges.append(f"{left} {piece[len(left) :]}")
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(
        [TokenType.NORMAL] * 256 + [TokenType.CONTROL] * 2 + [TokenType.NORMAL] * len(pieces)
    )
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    for name, flag in flags.items():
        writer.add_bool(f"tokenizer.ggml.{name}", flag)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _assert_encodes_like_transformers(path: str, texts: list[str]) -> Tokenizer:
    from transformers import AutoTokenizer

    ours = gguf_tokenizer(GGUFFile(path))
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    return ours


@pytest.mark.parametrize("add_bos_token", [True, False])
def test_add_eos_token_sentencepiece(spm_models, tmp_path: Path, add_bos_token: bool) -> None:
    flags = {"add_bos_token": add_bos_token, "add_eos_token": True}
    path = _sentencepiece_gguf(tmp_path, spm_models[True], flags)
    ours = _assert_encodes_like_transformers(path, ["Hello, world! the quick brown fox", ""])
    bos, eos = ours.token_to_id("<s>"), ours.token_to_id("</s>")
    plain = ours.encode("the fox", add_special_tokens=False)
    assert ours.encode("the fox") == ([bos] if add_bos_token else []) + plain + [eos]
    assert ours.decode(ours.encode("the fox")) == "the fox"


def test_add_eos_token_byte_level(tmp_path: Path) -> None:
    path = _byte_level_gguf(
        tmp_path / "vocab.gguf", "gpt-2", ["he", "hel", "hell", "hello"], {"add_eos_token": True}
    )
    ours = _assert_encodes_like_transformers(path, ["hello hello", ""])
    assert ours.encode("hello") == [ours.token_to_id("hello"), 257]


@pytest.mark.parametrize("pre", ["default", None])
def test_default_pre_tokenizer_as_llama_cpp(tmp_path: Path, pre: str | None) -> None:
    """llama.cpp splits runs of punctuation first ("'s" and " ," come apart), then as GPT-2, then cuts runs
    of digits into threes (" 12345" -> " ", "123", "45"). With "gpt-2" the same merges make whole pieces."""
    # "Ġ" is a space in the GPT-2 byte alphabet.
    pieces = ["Ġ1", "Ġ12", "Ġ123", "Ġ1234", "Ġ12345", "12", "123", "45", "'s", "Ġ,"]
    text = "it's 12345 ,"

    def encoded(name: str | None) -> list[str | None]:
        tokenizer = gguf_tokenizer(GGUFFile(_byte_level_gguf(tmp_path / f"{name}.gguf", name, pieces, {})))
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        return [tokenizer.id_to_token(i) for i in ids]

    assert encoded(pre) == ["i", "t", "'", "s", "Ġ", "123", "45", "Ġ", ","]
    assert encoded("gpt-2") == ["i", "t", "'s", "Ġ12345", "Ġ,"]
