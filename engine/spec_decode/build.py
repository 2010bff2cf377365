"""Builds the proposer an `EngineConfig.speculative` asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sluice.engine.config import EngineConfig
from sluice.engine.spec_decode.ngram_proposer import NgramProposer
from sluice.engine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from sluice.engine.loading.model_loader import ModelSource
    from sluice.engine.worker.model_runner import ModelRunner


def build_proposer(config: EngineConfig, source: ModelSource, target: ModelRunner) -> Proposer | None:
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    from sluice.engine.spec_decode.draft_proposer import DraftProposer

    return DraftProposer(config, source, target)
