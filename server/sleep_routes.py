"""Sleep mode over HTTP, in vLLM's shape: `POST /sleep?level=1|2`, `POST /wake_up`,
`GET /is_sleeping` (`{"is_sleeping": bool}`). While asleep, generation routes answer 503
in the route's error shape; a change the engine refuses (requests in flight, already
asleep, not asleep, no sleep mode on the platform) is a 409, a bad level a 400.

These are the routes that change the engine: they exist only with `--enable-sleep-mode`,
and each needs the admin key (`--admin-api-key`): without it 401, with a client key 403.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel

from tokenmill.server.middleware import key_matches, presented_keys
from tokenmill.server.responses import OpenAIError
from tokenmill.server.serving import APIError, error_response, state_of
from tokenmill.worker.sleep_mode import SLEEP_LEVELS


def require_admin(request: Request) -> None:
    """The admin key, or 401 (none, or a wrong one) / 403 (a client key)."""
    state = state_of(request)
    keys = presented_keys(request.scope.get("headers", ()))
    if key_matches(keys, state.admin_api_key):
        return
    if key_matches(keys, state.api_key):
        raise APIError(403, f"{request.url.path} changes the engine: it needs the admin key "
                       "(--admin-api-key), not a client key", code="permission_denied")
    raise APIError(401, f"{request.url.path} needs the admin key: send `Authorization: Bearer "
                   "ADMIN_KEY` or `x-api-key: ADMIN_KEY`", code="invalid_api_key")


_ERRORS = {400: {"model": OpenAIError}, 401: {"model": OpenAIError},
           403: {"model": OpenAIError}, 409: {"model": OpenAIError}}
router = APIRouter(dependencies=[Depends(require_admin)], responses=_ERRORS)
ADMIN_PATHS = frozenset({"/sleep", "/wake_up", "/is_sleeping"})


class SleepingResponse(BaseModel):
    is_sleeping: bool


@router.post("/sleep", response_class=Response)
async def sleep(request: Request, level: int = Query(1)) -> Response:
    """Free the engine's device memory: level 1 keeps the weights in host memory, level 2
    discards them too (wake reads the checkpoint again); the KV cache is discarded."""
    if level not in SLEEP_LEVELS:
        return error_response(request.url.path, 400, f"sleep level {level} is not one of "
                              f"{SLEEP_LEVELS}", "level")
    try:
        await state_of(request).engine.sleep(level)
    except RuntimeError as e:
        return error_response(request.url.path, 409, str(e))
    return Response(status_code=200)


@router.post("/wake_up", response_class=Response)
async def wake_up(request: Request) -> Response:
    try:
        await state_of(request).engine.wake_up()
    except RuntimeError as e:
        return error_response(request.url.path, 409, str(e))
    return Response(status_code=200)


@router.get("/is_sleeping", response_model=SleepingResponse)
async def is_sleeping(request: Request) -> SleepingResponse:
    return SleepingResponse(is_sleeping=state_of(request).engine.is_sleeping)
