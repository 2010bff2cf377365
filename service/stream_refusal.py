"""Refusing a call whose client streams requests, so that the client sees the server's status.

If the server ends such a call while the client is still writing, the client's pending write fails
with the stream, and a grpc.aio client then overwrites the status the server sent with INTERNAL
"Internal error from Core" (grpc/grpc#36066; `_StreamRequestMixin._write` calls `set_internal_error`).
On loopback that hit about 1 refused StreamGenerate call in 8. Measured, and no help: `set_code` +
return instead of `abort`, sending initial metadata first, and reading only the first request (it
still raced once the client wrote two). Only a client that has stopped writing is safe. So a
refusing handler first reads and drops requests until the client half-closes, or has been quiet for
`quiet_s`, or `max_s` has passed; then it ends the call with its status.

    client  ──req──req──req──half-close            (or quiet for quiet_s, or max_s gone)
    server  ──read─read─read─EOF──> abort(UNAVAILABLE, message)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

# A client that writes in a burst sends its next message well within this; one that keeps the stream
# open waits this long for its refusal.
QUIET_S = 0.25
# Short: once no request is left, a draining server closes the calls still open (SluiceServer.drain).
MAX_S = 0.9


async def drain_request_stream(
    requests: AsyncIterator[object], *, quiet_s: float = QUIET_S, max_s: float = MAX_S
) -> None:
    """Reads and drops `requests` until the client half-closes, sends nothing for `quiet_s`, or
    `max_s` has passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_s
    iterator = aiter(requests)
    while (time_left := deadline - loop.time()) > 0:
        try:
            await asyncio.wait_for(anext(iterator), min(quiet_s, time_left))
        except (StopAsyncIteration, TimeoutError):
            break
