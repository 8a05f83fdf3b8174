"""The HTTP edge's error middleware: a client that leaves is not a server error."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aiohttp.client_exceptions import ClientConnectionResetError
from aiohttp.test_utils import make_mocked_request

from gateway.http_edge import error_middleware


async def test_a_client_that_left_is_neither_logged_as_a_bug_nor_answered(caplog) -> None:
    """A load generator cancels streams at the end of each rate: writing the headers then fails with the transport
    closing. That is no internal error: no traceback, no 500 body, nothing counted; aiohttp drops the connection."""
    async def handler(request: Any) -> Any:
        raise ClientConnectionResetError("Cannot write to closing transport")

    middleware = error_middleware(None)
    request = make_mocked_request("POST", "/v1/chat/completions")
    with caplog.at_level(logging.DEBUG, logger="gateway.http_edge"), pytest.raises(ConnectionResetError):
        await middleware(request, handler)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_bug_is_logged_and_answered_as_an_internal_error(caplog) -> None:
    async def handler(request: Any) -> Any:
        raise RuntimeError("boom")

    response = await error_middleware(None)(make_mocked_request("GET", "/v1/models"), handler)
    assert response.status == 500
    assert any(r.levelno >= logging.ERROR for r in caplog.records)
