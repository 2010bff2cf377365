"""Turning a caller's prompt (text, token ids, or chat messages) into validated token ids."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sluice.engine.errors import ContextLengthError, InvalidRequestError
from sluice.engine.model_info import ModelInfo
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.text.chat_messages import template_messages
from sluice.engine.text.chat_template import ChatTemplateOptions

if TYPE_CHECKING:
    from sluice.engine.text.tokenizer import Tokenizer


def resolve_prompt(
    tokenizer: Tokenizer | None,
    *,
    text: str | None = None,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    tools: Sequence[dict] | None = None,
    chat_options: ChatTemplateOptions | None = None,
    context: int | None = None,
) -> list[int]:
    """Exactly one of `text`, `token_ids`, `messages`; returns the prompt's token ids. `tools` (with
    `messages` only) are rendered by the chat template, as `chat_options` say (None: the defaults);
    `messages` as `template_messages` takes them. `context` (the model's; None where the prompt is to be
    truncated): a text or rendered chat past it may be refused from a prefix (`Tokenizer.encode`)."""
    given = [name for name, v in (("text", text), ("token_ids", token_ids), ("messages", messages)) if v]
    if len(given) != 1:
        if not given:
            raise InvalidRequestError("prompt", "is empty: give text, token_ids or messages")
        raise InvalidRequestError("prompt", f"give exactly one of text, token_ids, messages (got {given})")
    if tools is not None and not messages:
        raise InvalidRequestError("tools", "need a chat prompt (messages)")
    if chat_options is not None and not messages:
        raise InvalidRequestError("chat_options", "need a chat prompt (messages)")
    if token_ids:
        return _token_ids(token_ids)
    if tokenizer is None:
        raise InvalidRequestError(given[0], "this model has no tokenizer; send token_ids")
    if messages:
        options = chat_options or ChatTemplateOptions()
        ids = tokenizer.encode_chat(
            template_messages(messages), tools=tools, **options.as_kwargs(), context=context
        )
        if not ids:  # e.g. a template that renders nothing for a role it does not know
            raise InvalidRequestError("messages", "the chat template renders them to no tokens")
        return ids
    ids = tokenizer.encode(text, context=context)
    if not ids:
        raise InvalidRequestError("text", "encodes to no tokens")
    return ids


def _token_ids(token_ids: Sequence[int]) -> list[int]:
    """Integers (numpy's too), never floats, bools or the bytes of a string, which int() would take."""
    if isinstance(token_ids, str | bytes):
        raise InvalidRequestError("token_ids", f"must be a list of integers, got {type(token_ids).__name__}")
    ids = []
    for token_id in token_ids:
        try:
            if isinstance(token_id, bool):
                raise TypeError
            ids.append(operator.index(token_id))
        except TypeError:
            raise InvalidRequestError("token_ids", f"must be integers, got {token_id!r}") from None
    return ids


def prompt_context(params: SamplingParams, max_model_len: int) -> int | None:
    """`resolve_prompt`'s `context`: the model's, unless the prompt is to be truncated to fit it."""
    return max_model_len if params.truncate_prompt_tokens is None else None


def truncated_prompt(
    prompt_token_ids: Sequence[int], params: SamplingParams, model_info: ModelInfo
) -> Sequence[int]:
    """The prompt's last `params.truncate_prompt_tokens` tokens, as vLLM keeps them (-1: as many as one
    request holds beside max_tokens, at least one: the model's context, or less where the KV cache or the
    step budget without chunked prefill holds less, which would then refuse it); the whole prompt when
    unset."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return prompt_token_ids
    most = model_info.max_request_tokens or model_info.max_model_len
    keep = max(1, most - params.max_tokens) if keep == -1 else keep
    return prompt_token_ids[-keep:] if len(prompt_token_ids) > keep else prompt_token_ids


def check_prompt(
    prompt_token_ids: Sequence[int], params: SamplingParams, model_info: ModelInfo, *, has_tokenizer: bool
) -> None:
    """Rejects prompts the model cannot serve, naming the field. The prompt's length before the scan of
    its ids, which runs on the event loop (with the ids' conversion to a list, it held the loop up to 4.9 s
    for a prompt of 20M tokens before its refusal)."""
    vocab_size, max_model_len = model_info.vocab_size, model_info.max_model_len
    if params.stop and not has_tokenizer:
        raise InvalidRequestError("stop", "stop strings need a tokenizer; this model has none")
    if params.constraint is not None and not has_tokenizer:
        raise InvalidRequestError(
            params.constraint.field, "constrained output needs a tokenizer; this model has none"
        )
    bad = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError("logit_bias", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t in params.allowed_token_ids or () if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            "allowed_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})"
        )
    # A stop token id past the vocabulary is never sampled: the request would run to max_tokens (vLLM
    # refuses it too).
    bad = next((t for t in params.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            "stop_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})"
        )
    check_min_tokens_leave_a_token(params, model_info.eos_token_ids)
    if len(prompt_token_ids) >= max_model_len:  # no max_tokens (>= 1) fits beside it: the prompt's to cut
        raise ContextLengthError(
            "prompt",
            f"{len(prompt_token_ids)} tokens leave no room for an output token in the model's context of "
            f"{max_model_len} tokens ({_shorten_hint(params)})",
        )
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError("token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise ContextLengthError(
            "max_tokens",
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the model's context of {max_model_len} tokens",
        )


def _shorten_hint(params: SamplingParams) -> str:
    if params.truncate_prompt_tokens is None:
        return "shorten it, or set truncate_prompt_tokens"
    return "keep fewer with truncate_prompt_tokens, or -1 to fit max_tokens"


def check_min_tokens_leave_a_token(params: SamplingParams, eos_token_ids: Sequence[int]) -> None:
    """Where the tokens min_tokens holds back are all the allowed_token_ids, nothing is left to sample.
    (A thinking chat's constraint waits for `</think>` only where allowed_token_ids hold it: never all
    held back then.)"""
    if params.min_tokens == 0 or params.allowed_token_ids is None:
        return
    under_constraint = params.constraint_applies(())  # at the first token
    if params.held_back_by_min_tokens(eos_token_ids, under_constraint).issuperset(params.allowed_token_ids):
        raise InvalidRequestError(
            "min_tokens",
            "holds back every allowed_token_ids entry (each is a stop token or eos): no token is left",
        )
