"""Builds the proposer an `EngineConfig.speculative` asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sluice.engine.config import EngineConfig
from sluice.engine.spec_decode.ngram_proposer import NgramProposer
from sluice.engine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from sluice.engine.worker.model_runner import ModelRunner


def build_proposer(config: EngineConfig, draft_runner: ModelRunner | None) -> Proposer | None:
    """`draft_runner`: the draft model's runner, which the target's (rank 0's) loaded and sized
    (`ModelRunner.draft_runner`); None unless the method is draft."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    from sluice.engine.spec_decode.draft_proposer import DraftProposer

    return DraftProposer(config, draft_runner)
