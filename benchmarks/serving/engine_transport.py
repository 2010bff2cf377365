"""The in-process transport: benchmark requests straight into an AsyncEngine, with no gRPC in between.

Driving the same workload through this and through a server measures what the gRPC layer costs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from sluice.bench.transports import BenchError, Chunk
from sluice.bench.workloads import BenchRequest
from sluice.engine.config import EngineConfig
from sluice.engine.frontend.async_engine import AsyncEngine
from sluice.engine.sampling_params import SamplingParams
from sluice.service.status import status_for


class EngineTransport:
    """Owns an AsyncEngine started on the running loop; `create` loads the model off the loop."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    @classmethod
    async def create(cls, config: EngineConfig) -> EngineTransport:
        engine = AsyncEngine(config)
        await engine.start()
        return cls(engine)

    async def generate(self, request_id: str, request: BenchRequest) -> AsyncIterator[Chunk]:
        params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
        try:
            stream = await self._engine.add_request(request_id, params, token_ids=request.prompt_token_ids)
        except Exception as error:  # the status the gRPC edge gives it, so both transports report alike
            code, message = status_for(error)
            raise BenchError(code.name, message) from None
        async for output in stream:
            if output.finish_reason in ("abort", "error"):
                raise BenchError(f"FINISH_REASON_{output.finish_reason.upper()}", output.error or "")
            if output.usage is not None:
                usage = output.usage
                yield Chunk(len(output.token_ids), usage.cached_tokens, usage.prompt_tokens_computed)
            elif output.token_ids:
                yield Chunk(len(output.token_ids))

    async def close(self) -> None:
        await self._engine.shutdown()
