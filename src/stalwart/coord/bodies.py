"""Request bodies on the lighthouse, read with a deadline and a size limit, and the quorum store's route.

Every handler reads its body through :func:`read_body` (a body sent byte by
byte is cut off, 408) and :func:`json_body` (400 unless JSON); the store's
route (:func:`serve_store`) checks the quorum's key before it reads the body,
and decodes a large body, and encodes a large answer, on a worker thread.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from stalwart.coord.protocol import STORE_KEY_HEADER, StoreRequest, parse_header
from stalwart.coord.store import QuorumStores, StoreLimits, answer_bytes, encode_answer
from stalwart.coord.wire import RequestError

MAX_BODY_BYTES = 64 * 1024
"""Largest request body, and a balanced ledger's heartbeat message (it carries the weights)."""
BODY_TIMEOUT = 10.0
"""Seconds a request's body may take to arrive (a body sent byte by byte is cut off: 408)."""
MAX_STORE_BODY_BYTES = 4 * (StoreLimits().value_bytes // 3 + 1) + 4096
"""Largest store request: the largest value in base64, and its JSON."""


async def read_body(request: web.BaseRequest) -> bytes:
    """The request's body, read within ``BODY_TIMEOUT`` (408 after) and its size limit (413 above)."""
    if request.content.is_eof():  # the whole body came with the headers (most requests): no timer to arm
        return await request.read()
    try:
        return await asyncio.wait_for(request.read(), BODY_TIMEOUT)
    except asyncio.TimeoutError:
        raise RequestError(408, f"the body did not arrive within {BODY_TIMEOUT:g} s") from None


def decode_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise RequestError(400, f"the body must be JSON: {error}") from error


async def json_body(request: web.BaseRequest) -> Any:
    """The request's JSON body (see :func:`read_body`); 400 when it is not JSON."""
    return decode_json(await read_body(request))


def parse_store_request(raw: bytes, max_value_bytes: int) -> StoreRequest:
    return StoreRequest.from_json(decode_json(raw), max_value_bytes)


def path_int(value: str, name: str) -> int:
    """A non-negative integer from the URL path; 400 naming it otherwise."""
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise RequestError(400, f"{name} must be a non-negative integer, got {value[:40]!r}", field=name)
    return int(value)


async def serve_store(stores: QuorumStores, request: web.Request) -> web.Response:
    """One operation on a quorum's store: its key is checked before the body is read.

    A large body is decoded, and a large answer encoded, on a worker thread: a value of megabytes (heal
    metadata) must not hold the event loop.
    """
    quorum_id = path_int(request.match_info["quorum_id"], "quorum_id")
    store = stores.get(quorum_id)
    store.check_key(parse_header(request.headers.get(STORE_KEY_HEADER), STORE_KEY_HEADER))
    raw = await read_body(request.clone(client_max_size=MAX_STORE_BODY_BYTES))
    loop = asyncio.get_running_loop()
    limit = store.limits.value_bytes
    if len(raw) > MAX_BODY_BYTES:
        operation = await loop.run_in_executor(None, parse_store_request, raw, limit)
    else:
        operation = parse_store_request(raw, limit)
    answer = await store.apply(operation)
    if answer_bytes(answer) > MAX_BODY_BYTES:  # at most StoreLimits.answer_bytes
        body = await loop.run_in_executor(None, encode_answer, answer)
    else:
        body = encode_answer(answer)
    return web.Response(body=body, content_type="application/json")
