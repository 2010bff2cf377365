"""Prefix-cache hits of an offline benchmark run: did it measure the engine, or the cache?

An engine's prefix cache serves any prompt prefix it has seen, in whole blocks. A run's prompts may share
a prefix by design (a chat template's system prompt, an agent's instructions): the cache may serve each
request at most the tokens every prompt of the run starts with. A request served more repeats a prompt
the engine saw before (an earlier run's, a warm-up's), so the run timed the cache, not the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sluice.engine.frontend.llm import Completion


@dataclass(frozen=True)
class CacheHits:
    cached_tokens: int  # prompt tokens served from the prefix cache, over the run's requests
    computed_tokens: int  # prompt tokens the engine ran through the model
    shared_prefix_len: int  # tokens every prompt of the run starts with (0 for a single prompt)
    num_unexpected: int  # requests served more than shared_prefix_len from the cache

    @classmethod
    def of(cls, completions: Sequence[Completion], shared_prefix_len: int | None = None) -> CacheHits:
        """The run's counts; `shared_prefix_len` defaults to the common prefix of its prompts."""
        if shared_prefix_len is None:
            shared_prefix_len = common_prefix_len([c.prompt_token_ids for c in completions])
        return cls(
            cached_tokens=sum(c.cached_tokens for c in completions),
            computed_tokens=sum(c.prompt_tokens_computed for c in completions),
            shared_prefix_len=shared_prefix_len,
            num_unexpected=sum(c.cached_tokens > shared_prefix_len for c in completions),
        )

    @property
    def unexpected(self) -> bool:
        return self.num_unexpected > 0

    def warning(self, run: str) -> str:
        """The line to print under a table when `unexpected`."""
        return (
            f"warning: {run}: {self.num_unexpected} requests hit the prefix cache ({self.cached_tokens} "
            f"prompt tokens cached) beyond the {self.shared_prefix_len} tokens the run's prompts share: "
            "that run measured the cache, not the engine"
        )


def common_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    """How many tokens all `prompts` start with; 0 with fewer than two prompts."""
    if len(prompts) < 2:
        return 0
    shortest = min(len(p) for p in prompts)
    first = prompts[0]
    return next((i for i in range(shortest) if any(p[i] != first[i] for p in prompts)), shortest)
