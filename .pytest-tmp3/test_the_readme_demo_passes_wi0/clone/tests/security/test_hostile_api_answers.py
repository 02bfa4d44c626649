"""What the operator's API client does with answers no API server should send. The API server is trusted, so this is
robustness rather than attack: an answer must never be taken for another's, and everything that goes wrong is an
OSError, which every caller treats as "the API server could not be reached". On main (the operator's own HTTP/1.1
client, kube_http.py) each of these went wrong as the test says."""

from __future__ import annotations

import pytest

from scripted_api import Scripted, ok
from trainingrun_operator.runtime.kube import ApiError

pytestmark = pytest.mark.asyncio


async def test_bytes_after_a_content_length_body_never_become_the_next_answer():
    """On main they stayed on the kept connection and were read as the next request's answer."""
    async with Scripted(ok(b"1") + ok(b'"smuggled"'), ok(b"2"), ok(b"3")) as s:
        assert await s.kube.request("GET", "/a") == 1
        second = await s.kube.request("GET", "/b")
        third = await s.kube.request("GET", "/c")
    assert (second, third) != ("smuggled", 2)  # never the extra bytes as an answer, nor answers shifted by one
    assert (second, third) == (2, 3)


@pytest.mark.parametrize("length", ["\u00b2", "\u0661", "1e3", " 1 2"], ids=["superscript", "arabic", "exp", "spaces"])
async def test_a_content_length_that_is_not_ascii_digits_is_an_oserror(length):
    """On main `Content-Length: ²` passed isdigit() and int() raised ValueError, not the promised OSError."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: " + length.encode() + b"\r\n\r\n1"
    async with Scripted(answer) as s:
        with pytest.raises(OSError, match="GET /a"):
            await s.kube.request("GET", "/a")


async def test_a_retry_after_that_is_not_ascii_digits_falls_back_to_the_backoff():
    throttled = "HTTP/1.1 503 Service Unavailable\r\nRetry-After: \u00b2\r\nContent-Length: 2\r\n\r\n{}".encode()
    async with Scripted(throttled, ok(b"5")) as s:
        assert await s.kube.request("GET", "/a") == 5


async def test_an_interim_100_continue_is_not_taken_for_the_answer():
    """On main `100 Continue` was the final answer (an empty 100), and the real one was left for the next request."""
    async with Scripted(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"1"), ok(b"2")) as s:
        assert await s.kube.request("POST", "/a", {"x": 1}) == 1
        assert await s.kube.request("GET", "/b") == 2


async def test_a_path_beyond_latin1_is_sent_percent_encoded_not_a_unicode_error():
    """On main a non-latin-1 path raised UnicodeEncodeError from building the request line."""
    async with Scripted(b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}") as s:
        with pytest.raises(ApiError) as refused:
            await s.kube.request("GET", "/api/v1/namespaces/ns/pods/\u0444")
    assert refused.value.status == 404
    assert s.requests[0].startswith(b"GET /prefix/api/v1/namespaces/ns/pods/%D1%84 HTTP/1.1\r\n")
