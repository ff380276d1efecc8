"""How uvicorn runs the app, for `tokenmill serve` and the server tests alike.

Streaming sends one HTTP chunk per token of every request, so uvicorn's per-chunk path is
a hot path: httptools (llhttp, a C parser and a lean send) and uvloop cost a fraction of
h11's pure-Python state machine and asyncio's loop (docs/benchmarks.md, "What serving
costs"). Both come with `uvicorn[standard]`; without them the server runs on h11 and
asyncio and logs that it fell back.
"""

from __future__ import annotations

import logging
from importlib.util import find_spec
from typing import Any

from tokenmill.server.protocol import MAX_HTTP_HEAD_BYTES

logger = logging.getLogger(__name__)


def uvicorn_options() -> dict[str, Any]:
    """`uvicorn.Config` keyword arguments: the HTTP implementation and the event loop.

    h11 gets a bound on a head it is still reading (MAX_HTTP_HEAD_BYTES), so heads up to
    it reach the app whole and get its 431; llhttp reads whole heads without one.
    """
    options: dict[str, Any] = {"h11_max_incomplete_event_size": MAX_HTTP_HEAD_BYTES}
    if find_spec("httptools") is not None:
        options["http"] = "httptools"
    else:
        logger.warning("httptools is not installed: serving HTTP with h11, slower per "
                       "streamed chunk (pip install 'uvicorn[standard]')")
        options["http"] = "h11"
    if find_spec("uvloop") is not None:
        options["loop"] = "uvloop"
    else:
        logger.warning("uvloop is not installed: running on asyncio's event loop, slower per "
                       "streamed chunk (pip install 'uvicorn[standard]')")
        options["loop"] = "asyncio"
    return options
