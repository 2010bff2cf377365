"""SentencePiece vocabularies in GGUF files (tokenizer.ggml.model "llama": Llama 2, Mistral, Gemma) against
transformers' tokenizer read from the same file, on multilingual text.

A byte-fallback BPE is trained here with the `sentencepiece` library and written as llama.cpp's
converter writes one (pieces, scores, token types, no merges), for a Llama and a Gemma 3 file.
"""

from __future__ import annotations

import os

import pytest
from gguf import GGUFWriter, TokenType

from sluice.engine.loading.gguf_file import GGUFFile
from sluice.engine.loading.gguf_tokenizer import gguf_tokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog; hello world, how are you today?",
    "Émile ate crème brûlée in Zürich — naïve café façade, Größe über schön",
    "Привет, мир! Как дела? 東京タワーは333メートルです。北京欢迎你 مرحبا بالعالم",
    "def f(x):\n    return {'a': x ** 2}  # numbers 0 1 2 3 42 1999",
] * 50
MULTILINGUAL = [
    "Hello, world! The café's naïve façade — über schön, Größe 42.",
    "  leading spaces,  double  spaces and a trailing one ",
    "東京タワーは333メートルです。北京欢迎你 🙂🚀👩‍💻 Привет мир مرحبا",
    "def f(x):\n    return {'a': x ** 2}\t\n\n<s>not special</s> <unk>",
    "ẞ ǅ ﬁ — unseen letters fall back to bytes: ∮ ⨌ 🜁",
]
# Text starting with a space or holding special tokens: llama.cpp puts "▁" before each stretch of a Llama
# vocabulary's text, transformers before the first only and not before a space (test_gguf_tokenizer_flags.py).
LLAMA_CPP_PREFIXES_DIFFERENTLY = (MULTILINGUAL[1], MULTILINGUAL[3])


def _train(directory: str) -> str:
    import sentencepiece as spm

    corpus = os.path.join(directory, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("\n".join(CORPUS))
    prefix = os.path.join(directory, "spm")
    spm.SentencePieceTrainer.train(
        input=corpus, model_prefix=prefix, vocab_size=600, model_type="bpe", byte_fallback=True,
        character_coverage=0.9995, minloglevel=2,
    )  # fmt: skip
    return prefix + ".model"


def _piece_type(sp, i: int) -> int:
    if sp.is_control(i):
        return TokenType.CONTROL
    if sp.is_unknown(i):
        return TokenType.UNKNOWN
    if sp.is_byte(i):
        return TokenType.BYTE
    return TokenType.USER_DEFINED if sp.is_unused(i) else TokenType.NORMAL


def write_sentencepiece_gguf(
    path: str,
    spm_model: str,
    arch: str,
    flags: dict[str, bool] | None = None,
    token_ids: dict[str, int] | None = None,
) -> None:
    """Tokenizer metadata as llama.cpp's converter writes it for a SentencePiece vocabulary; `flags`:
    `tokenizer.ggml.<name>` booleans beside add_bos_token (true unless stated); `token_ids`:
    `tokenizer.ggml.<name>_token_id`s beside bos, eos and unknown (padding, eot, ...)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=spm_model)
    size = sp.get_piece_size()
    writer = GGUFWriter(path, arch)
    writer.add_name(f"tiny {arch} spm")
    for add, value in [
        (writer.add_block_count, 1), (writer.add_context_length, 64), (writer.add_embedding_length, 16),
        (writer.add_feed_forward_length, 32), (writer.add_head_count, 1), (writer.add_head_count_kv, 1),
        (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_tokenizer_model, "llama"),
        (writer.add_tokenizer_pre, "default"),
        (writer.add_token_list, [sp.id_to_piece(i) for i in range(size)]),
        (writer.add_token_scores, [sp.get_score(i) for i in range(size)]),
        (writer.add_token_types, [_piece_type(sp, i) for i in range(size)]),
        (writer.add_bos_token_id, sp.bos_id()), (writer.add_eos_token_id, sp.eos_id()),
        (writer.add_unk_token_id, sp.unk_id()),
    ]:  # fmt: skip
        add(value)
    for name, flag in {"add_bos_token": True, **(flags or {})}.items():
        writer.add_bool(f"tokenizer.ggml.{name}", flag)
    for name, token_id in (token_ids or {}).items():
        writer.add_uint32(f"tokenizer.ggml.{name}_token_id", token_id)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _train(str(tmp_path_factory.mktemp("spm")))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sentencepiece_gguf_encodes_and_decodes_like_transformers(spm_model, tmp_path, arch):
    from transformers import AutoTokenizer

    path = str(tmp_path / f"{arch}.gguf")
    write_sentencepiece_gguf(path, spm_model, arch)
    ours = gguf_tokenizer(GGUFFile(path))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    for text in MULTILINGUAL:
        expected = theirs.encode(text)
        if arch == "gemma3" or text not in LLAMA_CPP_PREFIXES_DIFFERENTLY:
            assert ours.encode(text) == expected, text
            assert ours.encode(text, add_special_tokens=False) == theirs.encode(
                text, add_special_tokens=False
            )
        assert expected[0] == ours.bos_token_id
        for skip in (True, False):
            assert ours.decode(expected, skip_special_tokens=skip) == theirs.decode(
                expected, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            ), text
    assert ours.vocab_size == 600


def test_byte_fallback_spells_unseen_characters_in_bytes(spm_model, tmp_path):
    path = str(tmp_path / "llama.gguf")
    write_sentencepiece_gguf(path, spm_model, "llama")
    ours = gguf_tokenizer(GGUFFile(path))
    ids = ours.encode("∮", add_special_tokens=False)
    # "▁" then the three UTF-8 bytes of U+222E as <0xE2> <0x88> <0xAE>.
    assert [ours.id_to_token(i) for i in ids][-3:] == ["<0xE2>", "<0x88>", "<0xAE>"]
    assert ours.decode(ids) == "∮"
