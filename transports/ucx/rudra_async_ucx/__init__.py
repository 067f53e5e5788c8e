"""UCX transport for rudra-async (``ucx://host:port``), built on ucxx.

UCX chooses the wire itself: RDMA verbs (InfiniBand, RoCE) where the host's UCX build has
them, otherwise TCP or shared memory (``UCX_TLS`` narrows the choice, ``UCX_NET_DEVICES``
picks the NIC). A frame travels as UCX tag messages on one endpoint
(:func:`rudra_async.wire.encode_messages`: the header, the msgpack metadata, then one
message per non-empty array segment), each received directly into the buffer a
``FrameReader(messages=True)`` names (the body's comes from the receiver's allocator), so
large segments move zero-copy where the transport allows it. Large messages use UCX's
rendezvous protocol: a receiver that stops consuming makes the sender wait.

The progress mode is ``blocking`` by default (the worker's event fd is watched by the
event loop: no busy polling, good for hosts shared with learners); set
``RUDRA_ASYNC_UCX_PROGRESS=polling`` or ``thread`` to change it before first use.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from rudra_async.errors import ConfigError, ConnectError, PeerGone
from rudra_async.transports.base import (
    Connection,
    OnAccept,
    OnConnection,
    ServingListener,
    Transport,
    format_host_port,
    parse_host_port,
)
from rudra_async.wire import FrameReader, Limits, encode_messages

_initialized = False
PROGRESS_ENV = "RUDRA_ASYNC_UCX_PROGRESS"
PROGRESS_MODES = ("blocking", "polling", "thread", "thread-polling")
_peers = itertools.count(1)  # numbers the accepted peers, whose address ucxx does not give


def _ucxx() -> Any:
    global _initialized
    import ucxx

    if not _initialized:
        mode = os.environ.get(PROGRESS_ENV) or "blocking"
        if mode not in PROGRESS_MODES:
            raise ConfigError(f"{PROGRESS_ENV} must be one of {', '.join(PROGRESS_MODES)}, got {mode!r}")
        ucxx.init(progress_mode=mode)
        _initialized = True
    return ucxx


def parse_url(url: str) -> tuple[str, int]:
    return parse_host_port(url, "ucx")


class UcxConnection(Connection):
    """A frame is the messages of ``wire.encode_messages`` on one endpoint; one task reads
    them in order, one ``FrameReader(messages=True).get_buffer()`` per message, and stops
    posting receives while the inbox is full."""

    def __init__(self, ep: Any, limits: Limits, peer: str) -> None:
        super().__init__(peer)
        self.ep = ep
        self.limits = limits
        self._send_lock = asyncio.Lock()
        self._reader = asyncio.get_running_loop().create_task(self._read_frames())

    async def _read_frames(self) -> None:
        reader = FrameReader(self.limits, self._allocate, messages=True, admit=self._admit)
        try:
            while await self._inbox_room():
                buf = reader.get_buffer()
                await self.ep.recv(np.frombuffer(buf, np.uint8))  # straight into the body's buffer
                self._advance(reader, len(buf))
        except Exception as exc:  # ucxx raises several unrelated types
            where = " in the middle of a frame" if reader.mid_frame else ""
            self._connection_lost(PeerGone(f"connection lost{where}: {exc}"))
        finally:
            reader.close()

    async def send(self, msg_type: int, meta: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> None:
        self._check_open()
        messages = self._sending(encode_messages(msg_type, meta, arrays, self.limits))
        started = False
        try:
            async with self._send_lock:  # a frame is several messages: never interleave two
                for message in messages:
                    started = True
                    await self.ep.send(np.frombuffer(message, np.uint8))
        except Exception as exc:
            self._check_open()
            raise PeerGone(f"connection lost while sending: {exc}") from None
        except BaseException:
            if started:  # cancelled mid-frame: the peer would read the next frame into this one's parts
                self.close()
            raise

    def _close_link(self) -> None:
        self._reader.cancel()
        self.ep.abort()


class UcxListener(ServingListener):
    def __init__(self, host: str, on_connection: OnConnection, limits: Limits, on_accept: OnAccept | None) -> None:
        super().__init__(on_connection, on_accept)
        self._limits = limits
        self._host = host
        self._listener: Any = None

    async def _handle(self, ep: Any) -> None:  # ucxx calls this in a task of its own
        await self.serve(UcxConnection(ep, self._limits, f"ucx://{self._host}#peer{next(_peers)}"))

    def _stop_accepting(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None


class UcxTransport(Transport):
    scheme = "ucx"

    async def listen(
        self, url: str, on_connection: OnConnection, *, limits: Limits = Limits(), on_accept: OnAccept | None = None
    ) -> UcxListener:
        """Listen on ``ucx://host:port`` (port 0 picks one). UCX listens on every interface."""
        host, port = parse_url(url)
        ucxx = _ucxx()
        listener = UcxListener(host, on_connection, limits, on_accept)
        try:
            listener._listener = ucxx.create_listener(listener._handle, port)
        except Exception as exc:
            raise ConnectError(f"cannot listen on {url}: {exc}") from None
        listener.address = format_host_port("ucx", host, listener._listener.port)
        return listener

    async def connect(self, url: str, *, limits: Limits = Limits(), timeout: float = 10.0) -> UcxConnection:
        host, port = parse_url(url)
        ucxx = _ucxx()
        try:
            ep = await asyncio.wait_for(ucxx.create_endpoint(host, port, connect_timeout=timeout), timeout)
        except asyncio.TimeoutError:
            raise ConnectError(f"cannot connect to {url}: no answer within {timeout:g} s") from None
        except Exception as exc:
            raise ConnectError(f"cannot connect to {url}: {exc}") from None
        return UcxConnection(ep, limits, url)


transport = UcxTransport()
