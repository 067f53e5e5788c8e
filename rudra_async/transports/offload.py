"""Large frames are written to their socket by a thread, not by the event loop.

Writing a frame of tens of megabytes to a TCP or Unix socket is a copy into the kernel that
takes milliseconds (a 100 MB frame: tens of milliseconds of CPU). Done by the event loop,
the loop serves nobody else meanwhile: a server answering λ learners could receive one
learner's gradient while it writes another's weights, on another core. So a stream
connection hands a frame whose body is at least :func:`min_bytes` to a sender thread,
which writes it with ``sendmsg`` (without the GIL) while the loop goes on; ``send``
returns once the thread has written every byte, as before. Frames stay in order: while a
thread writes one, the connection's next frame waits for it.

A frame may also be sent while its body is still being computed (a server's reply with the
weights of an update that its update thread is computing): a :class:`Gate` tells the
thread how many bytes of the body are final, and the thread writes no byte before it is.

Not offloaded: TLS connections (the TLS layer writes through the loop), and a frame that
finds bytes still waiting in the loop's write buffer.

The threshold is process-wide: ``RUDRA_ASYNC_SEND_THREAD_BYTES`` (bytes of body, 0 turns
offloading off; unset or empty: 4 MiB) read when this module is first imported, or
:func:`set_min_bytes`.
"""

from __future__ import annotations

import asyncio
import select
import socket
import threading
from collections.abc import Sequence
from typing import Protocol

from ..errors import ConfigError, ConnectionClosed
from ..options import env_value

DEFAULT_MIN_BYTES = 4 << 20
ENV = "RUDRA_ASYNC_SEND_THREAD_BYTES"
#: how often a thread waiting for room in the socket looks whether its send was abandoned
STOP_CHECK_S = 0.05
_IOV_MAX = 512  # buffers per sendmsg call (Linux allows 1024)


def _checked(nbytes: int, source: str) -> int:
    if nbytes < 0:
        raise ConfigError(f"{source} must be a number of bytes >= 0 (0: never), got {nbytes!r}")
    return nbytes


_min_bytes = _checked(env_value(ENV, DEFAULT_MIN_BYTES, int, "a whole number of bytes"), ENV)


def min_bytes() -> int:
    """The smallest body a sender thread writes (0: none does)."""
    return _min_bytes


def set_min_bytes(nbytes: int) -> None:
    """Set the threshold of this process (0 turns offloading off); applies to the next frame."""
    global _min_bytes
    _min_bytes = _checked(nbytes, "the send-thread threshold")


def wanted(body_bytes: int) -> bool:
    """Whether a frame with a body of ``body_bytes`` goes to a sender thread."""
    return 0 < _min_bytes <= body_bytes


class Gate(Protocol):
    """How much of a body being computed is final: its first bytes, in order."""

    def wait(self, nbytes: int, timeout: float) -> int:
        """Wait until at least the first ``nbytes`` bytes are final, or ``timeout`` seconds;
        return how many are final now. Raises if the computation failed (nothing more
        will become final)."""
        ...


def wait_final(gate: Gate, nbytes: int) -> None:
    """Block until the first ``nbytes`` bytes behind ``gate`` are final."""
    while gate.wait(nbytes, STOP_CHECK_S) < nbytes:
        pass


def start(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    parts: Sequence[bytes | memoryview],
    stop: threading.Event,
    gate: Gate | None = None,
    body_at: int = 0,
) -> asyncio.Future[None]:
    """Run :func:`write_all` in a new daemon thread (a thread whose peer never reads again
    cannot hold up the process's exit); the future, of ``loop``, gets its outcome (marked
    as seen: a sender that was cancelled meanwhile no longer asks for it)."""
    done: asyncio.Future[None] = loop.create_future()
    done.add_done_callback(lambda job: job.cancelled() or job.exception())

    def settle(error: Exception | None) -> None:
        if done.cancelled():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def run() -> None:
        error: Exception | None = None
        try:
            write_all(sock, parts, stop, gate, body_at)
        except Exception as exc:  # reported to the sender, whatever it is
            error = exc
        try:
            loop.call_soon_threadsafe(settle, error)
        except RuntimeError:  # the loop is closed: nobody waits for this frame any more
            pass

    threading.Thread(target=run, name="rudra-send", daemon=True).start()
    return done


def write_all(
    sock: socket.socket,
    parts: Sequence[bytes | memoryview],
    stop: threading.Event,
    gate: Gate | None = None,
    body_at: int = 0,
) -> None:
    """Write ``parts`` in order to the non-blocking ``sock``, waiting for room as needed,
    then close ``sock`` (a duplicate of the connection's socket: the connection stays).
    With a ``gate``, the bytes from ``body_at`` on (the body) are written only once the gate
    says they are final. Raises ConnectionClosed once ``stop`` is set (checked at least
    every ``STOP_CHECK_S`` while waiting), the OSError of a broken link, and the gate's
    error. Never raises SIGPIPE."""
    with sock:
        _write_all(sock, parts, stop, gate, body_at)


def _write_all(
    sock: socket.socket, parts: Sequence[bytes | memoryview], stop: threading.Event, gate: Gate | None, body_at: int
) -> None:
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    total = sum(v.nbytes for v in views)
    final = total if gate is None else body_at  # bytes that may be written
    written = 0
    waiter = select.poll()
    waiter.register(sock.fileno(), select.POLLOUT)
    while views:
        if stop.is_set():
            raise ConnectionClosed("the connection was closed while a frame was being written")
        if written == final:
            assert gate is not None, "without a gate every byte is final"
            final = min(total, body_at + gate.wait(written - body_at + 1, STOP_CHECK_S))
            continue
        try:
            sent = sock.sendmsg(_prefix(views[:_IOV_MAX], final - written), (), socket.MSG_NOSIGNAL)
        except BlockingIOError:
            waiter.poll(STOP_CHECK_S * 1000)
            continue
        written += sent
        while sent:
            head = views[0]
            if sent < head.nbytes:
                views[0] = head[sent:]
                break
            sent -= head.nbytes
            views.pop(0)


def _prefix(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """The first ``nbytes`` bytes of ``views`` (all of them if they hold no more)."""
    out: list[memoryview] = []
    for v in views:
        if nbytes <= 0:
            break
        out.append(v if v.nbytes <= nbytes else v[:nbytes])
        nbytes -= v.nbytes
    return out
