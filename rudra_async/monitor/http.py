"""A very small HTTP/1.1 server on the server's own event loop, for ``/metrics``, the status
page and its JSON: GET and HEAD only, one request per connection, bounded request size,
time and connections, so a scraper or a browser never competes with training for more than
the time it takes to render one answer.

It runs on the event loop (not in a thread) so that each answer reads the server's state
between two events, never in the middle of one. A client has :data:`REQUEST_TIMEOUT_S` to
send its request; when every slot is taken, the oldest connection still waiting for its
request makes room, so idle connections cannot lock scrapers out. A path's answer is
rendered at most once every :data:`RENDER_EVERY_S`; requests in between get the same bytes,
so clients fetching in a loop cost the loop little more than their connections.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from ..errors import ConnectError
from ..logs import rate_limited

log = rate_limited(logging.getLogger(__name__))

Route = Callable[[str], tuple[int, str, bytes]]  # path -> (status, content type, body)

MAX_REQUEST = 16 * 1024  # request line and headers
REQUEST_TIMEOUT_S = 2.0  # to send the request (a scraper sends it at once)
TIMEOUT_S = 10.0  # to take the answer
MAX_CONNECTIONS = 32
#: a path's 200 answer is reused for this long (seconds) before it is rendered again
RENDER_EVERY_S = 0.1
REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
}


class HttpServer:
    """Answers GET/HEAD requests with ``route(path)``; with a ``token``, only requests that
    carry it (``Authorization: Bearer TOKEN``, compared in constant time), others 401."""

    def __init__(self, route: Route, token: bytes | None = None) -> None:
        self.route = route
        self.token = token
        self.url = ""
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: connections still reading their request, oldest first
        self._waiting: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        #: per path, the last 200 answer and when it was rendered (few paths answer 200)
        self._rendered: dict[str, tuple[float, tuple[int, str, bytes]]] = {}

    async def start(self, host: str, port: int) -> None:
        try:
            self._server = await asyncio.start_server(self._client, host, port, limit=MAX_REQUEST)
        except OSError as exc:
            raise ConnectError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
        bound = self._server.sockets[0].getsockname()
        self.url = f"http://[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"http://{bound[0]}:{bound[1]}"
        log.info("metrics and status page on %s/", self.url)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._tasks) >= MAX_CONNECTIONS and self._waiting:
            self._evict_oldest_waiting()
        if len(self._tasks) >= MAX_CONNECTIONS:
            writer.close()
            return
        self._tasks.add(task)
        self._waiting[task] = writer
        finished = False
        try:
            status, ctype, body, head = await self._answer(reader)
            self._waiting.pop(task, None)
            challenge = 'WWW-Authenticate: Bearer realm="rudra-async"\r\n' if status == 401 else ""
            writer.write(
                f"HTTP/1.1 {status} {REASONS[status]}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                f"{challenge}Cache-Control: no-store\r\nConnection: close\r\n\r\n".encode("latin-1")
            )
            if not head:
                writer.write(body)
            await asyncio.wait_for(writer.drain(), TIMEOUT_S)
            finished = True
        except (OSError, asyncio.TimeoutError, asyncio.CancelledError):
            pass  # cancelled: evicted, or the server closes; either way this connection just ends
        finally:
            self._tasks.discard(task)
            self._waiting.pop(task, None)
            if finished:
                writer.close()
            else:
                writer.transport.abort()  # nothing left to flush to a client that did not take it

    def _evict_oldest_waiting(self) -> None:
        """Free the slot of the oldest connection still waiting for its request, now."""
        task = next(iter(self._waiting))
        self._waiting.pop(task).transport.abort()
        self._tasks.discard(task)
        task.cancel()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, str, bytes, bool]:
        """(status, content type, body, whether it is a HEAD request)."""
        plain = "text/plain; charset=utf-8"
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ValueError):
            return 400, plain, b"bad request\n", False
        parts = request.split(b"\r\n", 1)[0].decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, plain, b"bad request\n", False
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return 405, plain, b"only GET and HEAD\n", False
        if self.token is not None and not _carries(request, self.token):
            return 401, plain, b"this server's metrics need its token (Authorization: Bearer TOKEN)\n", method == "HEAD"
        try:
            path = urlsplit(target).path
        except ValueError:  # e.g. an unclosed [IPv6 bracket
            return 400, plain, b"bad request\n", False
        try:
            status, ctype, body = self._render(path)
        except Exception:  # a bug in a route must not take the server down
            log.exception("answering %s failed", target)
            return 500, plain, b"internal error\n", method == "HEAD"
        return status, ctype, body, method == "HEAD"

    def _render(self, path: str) -> tuple[int, str, bytes]:
        """``route(path)``, or its last 200 answer if that is under :data:`RENDER_EVERY_S` old."""
        now = time.monotonic()
        last = self._rendered.get(path)
        if last is not None and now - last[0] < RENDER_EVERY_S:
            return last[1]
        answer = self.route(path)
        if answer[0] == 200:
            self._rendered[path] = (now, answer)
        return answer


def _carries(request: bytes, token: bytes) -> bool:
    """Whether the request's headers hold ``Authorization: Bearer <token>`` (constant-time)."""
    for line in request.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"authorization":
            scheme, _, given = value.strip().partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token)
    return False
