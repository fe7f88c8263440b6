"""Graceful shutdown. After SIGTERM the server keeps listening: /health and new requests get a 503
(so load balancers and clients see the drain, not a refused connection) while running requests
finish, for up to the drain timeout; what still runs then is aborted (its stream ends with an
"abort" chunk and [DONE], which uvicorn's graceful shutdown waits for). Only then is the server
told to close its listener.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gemma4serve.server.state import ServerState

logger = logging.getLogger("gemma4serve.server")

POLL_S = 0.05  # draining is switched on in a signal handler, where asyncio objects are off limits


async def drain_when_asked(state: ServerState) -> None:
    """Wait for `state.draining`, let running requests finish for up to the settings'
    `drain_timeout` seconds (or until `state.cut_drain()`), abort the rest, then call
    `state.on_drained` (the CLI's: close the listener)."""
    while not state.draining:
        await asyncio.sleep(POLL_S)
    loop = asyncio.get_running_loop()
    started, timeout = loop.time(), state.settings.drain_timeout
    while state.inflight and not state.drain_cut and loop.time() < started + timeout:
        await asyncio.sleep(POLL_S)
    if state.inflight:
        logger.warning(
            "aborting %d running request(s) after %.1fs of drain (timeout %.0fs)",
            len(state.inflight),
            loop.time() - started,
            timeout,
        )
        state.abort_inflight()
    if state.on_drained is not None:
        state.on_drained()
