"""Build a `Tokenizer` from the `tokenizer.*` metadata of a GGUF file.

A GGUF carries no `tokenizer.json`: it stores the vocabulary, the merges, each token's type and the special
token ids under llama.cpp's key names. Byte-level BPE (`tokenizer.ggml.model == "gpt2"`, used by
SmolLM2, Llama 3 and Qwen2) is rebuilt here with the `tokenizers` library; SentencePiece vocabularies
(`"llama"`: Llama 2, Mistral, Gemma) by `sluice.engine.loading.sentencepiece_gguf`:

    tokens + merges        -> BPE model (tokens are already spelled in the GPT-2 byte alphabet)
    token_type CONTROL     -> added special tokens (`<|im_start|>`), matched whole, skipped on decode
    token_type USER_DEFINED-> added plain tokens, matched whole
    tokenizer.ggml.pre     -> the pre-tokenizer split the merges were learned with ("default", or no key:
                              llama.cpp's own regexes, not GPT-2's split as in transformers)

Special ids, BOS, EOS and the chat templates are read as llama.cpp reads them (src/llama-vocab.cpp,
`llama_vocab::impl::load`; common/chat.cpp): generation also ends on end-of-turn tokens found by name
(`<end_of_turn>`, `<|eot_id|>`, ...) where the file names no eot id; BOS is added by default for a
SentencePiece vocabulary and for the Llama 3 pre-tokenizer, EOS where `add_eos_token` says so;
`tokenizer.chat_template.<name>` keys are the named templates ("tool_use" renders requests with tools).
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from sluice.engine.loading.gguf_file import GGUFFile
from sluice.engine.loading.sentencepiece_gguf import GEMMA_ARCHITECTURES, sentencepiece_bpe
from sluice.engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")

_SPECIAL_ID_KEYS = tuple(f"tokenizer.ggml.{name}_token_id" for name in ("bos", "eos", "unknown", "padding"))
_CONTROL = 3  # llama.cpp's token types
_USER_DEFINED = 4

# Token texts llama.cpp's vocabulary loader treats as end of generation, whatever the file's ids say, less
# the ones that end a document rather than a turn ("<|endoftext|>", "</s>", "<eos>": a file's eos names the
# one the model uses, and Gemma 3's vocabulary has "</s>" as an ordinary HTML tag).
END_OF_TURN_TOKENS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<EOT>",
    "<end_of_utterance>",
)
# The Llama 3 pre-tokenizer: llama.cpp adds BOS when the file has no tokenizer.ggml.add_bos_token, and
# looks a whole piece up in the vocabulary before merging (`ignore_merges`, as Llama 3's tokenizer.json).
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's "default" (also a file that names no pre-tokenizer): runs of punctuation, then the GPT-2 split,
# runs of digits, and each run cut into threes; each regex splits the pieces the ones before it left.
_DEFAULT_SPLITS = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_split() -> pre_tokenizers.PreTokenizer:
    # SmolLM2's own tokenizer.json: every digit is its own piece, then the GPT-2 split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _regex_split(*patterns: str):
    """Split by each pattern in turn (matches and the text between them are pieces), as llama.cpp's
    `unicode_regex_split`, then spell the pieces' bytes in the GPT-2 alphabet."""

    def build() -> pre_tokenizers.PreTokenizer:
        splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in patterns]
        return pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )

    return build


# tokenizer.ggml.pre -> builder of the pre-tokenizer (llama.cpp's llama-vocab.cpp names).
_PRE_TOKENIZERS = {
    "default": _regex_split(*_DEFAULT_SPLITS),
    "gpt-2": _gpt2_split,
    "smollm": _digits_then_gpt2_split,
    "llama-bpe": _regex_split(_LLAMA3_SPLIT),
    "llama3": _regex_split(_LLAMA3_SPLIT),
    "llama-v3": _regex_split(_LLAMA3_SPLIT),
    "smaug-bpe": _regex_split(_LLAMA3_SPLIT),
    "qwen2": _regex_split(_QWEN2_SPLIT),
    "deepseek-r1-qwen": _regex_split(_QWEN2_SPLIT),
}
SUPPORTED_PRE_TOKENIZERS = tuple(_PRE_TOKENIZERS)


def gguf_tokenizer(file: GGUFFile) -> Tokenizer:
    """The tokenizer a GGUF file describes. Raises ValueError naming the key when it is not supported."""
    model = file.metadata.get("tokenizer.ggml.model")
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise ValueError(
            f"tokenizer.ggml.model: {model!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}"
        )
    tokens: list[str] | None = file.metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("tokenizer.ggml.tokens: missing from the GGUF metadata")
    metadata = _with_special_ids_in_vocabulary(file.metadata, len(tokens))
    backend = _sentencepiece(metadata, tokens) if model == "llama" else _byte_level(metadata, tokens)
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_ids = _eos_token_ids(metadata, tokens)
    bos_by_default = model == "llama" or metadata.get("tokenizer.ggml.pre") in _LLAMA3_PRE
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", bos_by_default))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    processor = _bos_eos_processor(tokens, bos_id if add_bos else None, eos_id if add_eos else None)
    if processor is not None:
        backend.post_processor = processor
    return Tokenizer(
        backend,
        chat_template=metadata.get("tokenizer.chat_template"),
        bos_token=None if bos_id is None else tokens[bos_id],
        eos_token=tokens[eos_ids[0]] if eos_ids else None,
        eos_token_ids=eos_ids,
        add_bos_token=add_bos,
        name=metadata.get("general.name", "gguf"),
        named_chat_templates=_named_chat_templates(metadata),
        special_tokens=_template_tokens(metadata, tokens),
    )


def _template_tokens(metadata: dict[str, Any], tokens: list[str]) -> dict[str, str]:
    """unk_token and pad_token, as transformers' GGUF conversion names them: chat templates may read them
    as bos_token and eos_token are read."""
    keys = {"unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}
    return {name: tokens[metadata[key]] for name, key in keys.items() if metadata.get(key) is not None}


def _byte_level(metadata: dict[str, Any], tokens: list[str]) -> BackendTokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"tokenizer.ggml.pre: {pre!r} is not supported; supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
        )
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type", [])
    merges = metadata.get("tokenizer.ggml.merges", [])
    backend = byte_level_bpe(tokens, merges, token_types, ignore_merges=pre in _LLAMA3_PRE)
    backend.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    return backend


def _sentencepiece(metadata: dict[str, Any], tokens: list[str]) -> BackendTokenizer:
    scores = metadata.get("tokenizer.ggml.scores")
    merges = metadata.get("tokenizer.ggml.merges")
    if scores is None and merges is None:
        raise ValueError("tokenizer.ggml.scores: missing from the GGUF metadata (needed without merges)")
    gemma = metadata.get("general.architecture") in GEMMA_ARCHITECTURES
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    return sentencepiece_bpe(
        tokens,
        scores or [0.0] * len(tokens),
        metadata.get("tokenizer.ggml.token_type", []),
        merges,
        gemma=gemma,
        unk_token=tokens[unk_id] if gemma and unk_id is not None else None,
        # llama.cpp's default is true; Gemma's files all say false (its SentencePiece model has no dummy
        # prefix), and transformers never prefixes Gemma.
        add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", not gemma)),
        special_ids=tuple(i for i in map(metadata.get, _SPECIAL_ID_KEYS) if i is not None),
    )


def byte_level_bpe(
    tokens: list[str], merges: list[str], token_types: list[int], *, ignore_merges: bool = False
) -> BackendTokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` over `tokens` (ids are list positions); `ignore_merges`: a
    pre-tokenized piece that is a token is that token, whatever the merges would make of it.

    Control tokens become special added tokens and user-defined ones plain added tokens, so both are
    matched whole in the text instead of being cut into bytes.
    """
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    bpe = models.BPE(
        vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges
    )
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer = _gpt2_split()
    backend.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, token_types, strict=False))
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, kind in typed if kind == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, kind in typed if kind == _USER_DEFINED]
    )
    return backend


def _bos_eos_processor(
    tokens: list[str], bos_id: int | None, eos_id: int | None
) -> processors.TemplateProcessing | None:
    """BOS before and EOS after each text where llama.cpp's `add_special` adds them (its `add_bos`,
    `add_eos`), as transformers' post-processor for `add_bos_token` / `add_eos_token`; None if neither."""
    if bos_id is None and eos_id is None:
        return None

    def part(sequence: str, type_id: int) -> str:
        bos = [] if bos_id is None else [f"{tokens[bos_id]}:{type_id}"]
        eos = [] if eos_id is None else [f"{tokens[eos_id]}:{type_id}"]
        return " ".join([*bos, f"${sequence}:{type_id}", *eos])

    special = [(tokens[i], i) for i in dict.fromkeys((bos_id, eos_id)) if i is not None]
    return processors.TemplateProcessing(
        single=part("A", 0), pair=f"{part('A', 0)} {part('B', 1)}", special_tokens=special
    )


def _with_special_ids_in_vocabulary(metadata: dict[str, Any], num_tokens: int) -> dict[str, Any]:
    """`metadata` less the special token ids (`tokenizer.ggml.*_token_id`) past the vocabulary, which
    llama.cpp ignores with a warning ("bad special token"): files carry 4294967295 (-1 written unsigned)
    for a padding or separator token they do not have."""
    bad = {
        key: value
        for key, value in metadata.items()
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and not 0 <= value < num_tokens
    }
    for key, value in bad.items():
        logger.warning("GGUF %s = %d is no token of the %d-token vocabulary; ignored", key, value, num_tokens)
    return {key: value for key, value in metadata.items() if key not in bad}


def _eos_token_ids(metadata: dict[str, Any], tokens: list[str]) -> tuple[int, ...]:
    """eos first; then, as llama.cpp, the end-of-turn / end-of-message ids (Llama 3 writes <|eot_id|>
    there) and the vocabulary's `END_OF_TURN_TOKENS` (Gemma 3's files name no eot id: <end_of_turn>)."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [int(metadata[key]) for key in keys if metadata.get(key) is not None]
    end_of_turn = set(END_OF_TURN_TOKENS)
    ids += [token_id for token_id, token in enumerate(tokens) if token in end_of_turn]
    return tuple(dict.fromkeys(ids))


def _named_chat_templates(metadata: dict[str, Any]) -> dict[str, str]:
    """`tokenizer.chat_template.<name>` (gguf-py writes a checkpoint's named templates there and lists the
    names in `tokenizer.chat_templates`)."""
    prefix = "tokenizer.chat_template."
    return {key.removeprefix(prefix): value for key, value in metadata.items() if key.startswith(prefix)}
