"""SentencePiece vocabularies from GGUF files (`tokenizer.ggml.model == "llama"`: Llama 2, Mistral, Gemma).

A GGUF stores a SentencePiece model as its pieces (`▁` for a space, `<0x41>` byte pieces), their
scores and types, rarely with merges. It is rebuilt as a `tokenizers` BPE with byte fallback, its merges
the way transformers rebuilds them (`integrations/gguf/gguf_tokenizer_mapping.py`):

    merges   the file's, else every split of a piece into two pieces of the vocabulary, ranked by the
             piece's score (Gemma: by its position in the file, which is its merge order)
    spaces   -> `▁` by a normalizer; with `tokenizer.ggml.add_space_prefix` one `▁` is prepended too, and
             decoding strips one leading space
    Gemma    pieces of 2+ real spaces respelled `▁▁`

The space prefix is llama.cpp's (`llama_vocab::impl::tokenize`, SPM): one space before every stretch of text
that starts the input or follows a special or added token, even one that starts with a space. As a normalizer
it reaches exactly those stretches (`tokenizers` normalizes the text between added tokens one stretch at a
time), as in Llama 2's own tokenizer.json (transformers' legacy `LlamaConverter`). transformers' GGUF
conversion differs: it ignores `add_space_prefix` = false, and its `Metaspace(prepend_scheme="first")`
prefixes only the input's first stretch, and none that already starts with a space.
"""

from __future__ import annotations

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

_CONTROL = 3  # llama.cpp's token types
_USER_DEFINED = 4
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def sentencepiece_bpe(
    tokens: list[str],
    scores: list[float],
    token_types: list[int],
    merges: list[str] | None,
    *,
    gemma: bool,
    unk_token: str | None,
    add_space_prefix: bool,
    special_ids: tuple[int, ...] = (),
) -> BackendTokenizer:
    """A byte-fallback BPE over the GGUF's pieces (ids are list positions). Control tokens and
    `special_ids` (the file's bos/eos/unk/pad) become special added tokens, user-defined ones plain
    added tokens, all matched whole. `add_space_prefix`: llama.cpp's space before each stretch of text."""
    # Gemma's runs of spaces are pieces the BPE reaches through the normalizer (" " -> "\u2581"), as
    # SentencePiece does; added whole they would also match a "\u2581" typed in the text (transformers'
    # converter leaves them out too).
    space_runs = {i for i, t in enumerate(tokens) if gemma and " " in t and not t.strip()}
    if gemma:
        tokens = ["\u2581" * len(t) if i in space_runs else t for i, t in enumerate(tokens)]
        ranks = {token: -index for index, token in enumerate(tokens)}
    else:
        ranks = dict(zip(tokens, scores, strict=False))
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else merges_from_vocab(vocab, ranks)
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, unk_token=unk_token)
    backend = BackendTokenizer(bpe)
    prefix = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "\u2581")])
    if gemma:
        backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous")
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    strip = [decoders.Strip(content=" ", left=1)] if add_space_prefix else []
    backend.decoder = decoders.Sequence([*steps, *strip])
    typed = list(zip(tokens, token_types, strict=False))
    special = [t for t, kind in typed if kind == _CONTROL]
    special += [tokens[i] for i in special_ids if tokens[i] not in special]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user_defined = [t for i, (t, kind) in enumerate(typed) if kind == _USER_DEFINED and i not in space_runs]
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])
    return backend


def merges_from_vocab(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a piece into two pieces, best-ranked piece first; ties: longer left,
    then longer right piece first, then by the pieces' ids (transformers' `generate_merges`)."""
    merges: list[tuple[str, str, float]] = []
    for piece, rank in ranks.items():
        local = [
            (piece[:i], piece[i:], rank)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]
