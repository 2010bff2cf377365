"""The model's vocabulary as xgrammar sees it: each token id's text in the tokenizer's own encoding.

Built from the `tokenizers` backend the way `xgrammar.TokenizerInfo.from_huggingface` builds it from a
transformers tokenizer (same vocab-type detection: byte-level BPE, byte-fallback or raw), with two
differences: the mask is as wide as the model's logits (`vocab_size`, which may exceed the tokenizer's
vocabulary: the extra ids get "" and are never allowed), and added special tokens (e.g. <|im_start|>)
also get "", so a grammar never allows them as text. Stop tokens are the engine's eos ids: the only
tokens allowed once the grammar is complete.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import xgrammar as xgr

if TYPE_CHECKING:
    from sluice.engine.text.tokenizer import Tokenizer


def build_tokenizer_info(
    tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Iterable[int]
) -> xgr.TokenizerInfo:
    """`vocab_size`: the model's logits width. Ids the tokenizer has at or beyond it are dropped."""
    backend = tokenizer.backend
    encoded_vocab = [""] * vocab_size
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            encoded_vocab[token_id] = token
    for token_id, added in backend.get_added_tokens_decoder().items():
        if added.special and token_id < vocab_size:
            encoded_vocab[token_id] = ""
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    stop = sorted(t for t in set(stop_token_ids) if t < vocab_size)
    return xgr.TokenizerInfo(
        encoded_vocab,
        vocab_type=metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stop or None,
        add_prefix_space=metadata["add_prefix_space"],
    )
