"""UCX transport for rudra-async (``ucx://host:port``), built on ucxx.

UCX chooses the wire itself: RDMA verbs (InfiniBand, RoCE) where the host's UCX build has
them, otherwise TCP or shared memory (``UCX_TLS`` narrows the choice, ``UCX_NET_DEVICES``
picks the NIC). A frame travels as UCX tag messages on one endpoint: the 24-byte header,
then the msgpack metadata, then one message per non-empty array segment, each received
directly into the body buffer (the receiver's allocator is honoured), so large segments
move zero-copy where the transport allows it.

The progress mode is ``blocking`` by default (the worker's event fd is watched by the
event loop: no busy polling, good for hosts shared with learners); set
``RUDRA_ASYNC_UCX_PROGRESS=polling`` or ``thread`` to change it before first use.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any, Sequence

import numpy as np

from rudra_async.errors import ConnectError, ConnectionClosed, PeerGone, WireError
from rudra_async.transports.base import (
    Connection,
    OnConnection,
    ServingListener,
    Transport,
    format_host_port,
    parse_host_port,
)
from rudra_async.wire import (
    HEADER_SIZE,
    BufferPool,
    Frame,
    Limits,
    decode_meta,
    encode_frame,
    parse_segments,
    unpack_header,
)

_initialized = False


def _ucxx() -> Any:
    global _initialized
    import ucxx

    if not _initialized:
        ucxx.init(progress_mode=os.environ.get("RUDRA_ASYNC_UCX_PROGRESS", "blocking"))
        _initialized = True
    return ucxx


def parse_url(url: str) -> tuple[str, int]:
    return parse_host_port(url, "ucx")


class UcxConnection(Connection):
    def __init__(self, ep: Any, limits: Limits, peer: str) -> None:
        self.ep = ep
        self.limits = limits
        self.peer = peer
        self.allocator = None
        self._send_lock = asyncio.Lock()
        self._queue: asyncio.Queue[Frame | BaseException] = asyncio.Queue()
        self._pool = BufferPool()
        self._closed = False
        self._lost: BaseException | None = None
        self._lost_future = asyncio.get_running_loop().create_future()
        self._reader = asyncio.get_running_loop().create_task(self._read_frames())

    # -- receiving: one task reads frames in order ---------------------------------------
    async def _recv_into(self, buf: np.ndarray) -> None:
        await self.ep.recv(buf)

    async def _read_frame(self) -> Frame:
        head = np.empty(HEADER_SIZE, np.uint8)
        await self._recv_into(head)
        header = unpack_header(head.tobytes(), self.limits)
        meta, specs = {}, []
        if header.meta_len:
            raw = np.empty(header.meta_len, np.uint8)
            await self._recv_into(raw)
            # a bad segment list is fatal here: the body's messages could not be matched up
            meta = decode_meta(raw.tobytes())
            specs = parse_segments(meta, header.body_len)
        elif header.body_len:
            raise WireError("a body without segment descriptors", code="malformed")
        body = None
        if self.allocator is not None and header.body_len:
            body = self.allocator(header.msg_type, meta, header.body_len)
        owned = self._pool.take(header.body_len) if body is None else None
        view = memoryview(owned)[: header.body_len] if owned is not None else body.cast("B")
        target = np.frombuffer(view, np.uint8) if header.body_len else np.empty(0, np.uint8)
        offset = 0
        for spec in specs:
            if spec.nbytes:
                await self._recv_into(target[offset : offset + spec.nbytes])
                offset += spec.nbytes
        release = (lambda: self._pool.give_back(owned)) if owned is not None else None
        return Frame(header.msg_type, meta, view, specs, None, release)

    async def _read_frames(self) -> None:
        try:
            while True:
                await self._queue.put(await self._read_frame())
        except WireError as exc:
            await self._queue.put(exc)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # ucxx raises several unrelated types
            self._lost = PeerGone(f"connection lost: {exc}")
            await self._queue.put(self._lost)
        finally:
            if not self._lost_future.done():
                self._lost_future.set_result(None)

    async def recv(self) -> Frame:
        if self._closed:
            raise ConnectionClosed("connection closed locally")
        if self._queue.empty() and self._lost_future.done() and self._lost is None:
            raise ConnectionClosed("connection closed locally")
        item = await self._queue.get()
        if isinstance(item, BaseException):
            await self._queue.put(item)  # stays broken for later calls
            if self._closed:
                raise ConnectionClosed("connection closed locally")
            raise item
        return item

    # -- sending --------------------------------------------------------------------------
    async def send(self, msg_type: int, meta: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> None:
        self._check_open()
        parts = encode_frame(msg_type, meta, arrays, self.limits)
        head = np.frombuffer(parts[0], np.uint8)
        try:
            async with self._send_lock:  # a frame is several messages: never interleave two
                await self.ep.send(head[:HEADER_SIZE])
                if len(head) > HEADER_SIZE:
                    await self.ep.send(head[HEADER_SIZE:])
                for part in parts[1:]:
                    await self.ep.send(np.frombuffer(part, np.uint8))
        except Exception as exc:
            self._check_open()
            raise PeerGone(f"connection lost while sending: {exc}") from None

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionClosed("connection closed locally")
        if self._lost is not None:
            raise self._lost

    @property
    def is_closed(self) -> bool:
        return self._closed or self._lost is not None

    async def wait_lost(self) -> None:
        await asyncio.shield(self._lost_future)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reader.cancel()
        try:
            self.ep.abort()
        except Exception:
            pass
        if not self._lost_future.done():
            self._lost_future.set_result(None)


class UcxListener(ServingListener):
    def __init__(self, host: str, on_connection: OnConnection, limits: Limits) -> None:
        super().__init__(on_connection)
        self._limits = limits
        self._host = host
        self._listener: Any = None

    async def _handle(self, ep: Any) -> None:  # ucxx calls this in a task of its own
        await self._serve(UcxConnection(ep, self._limits, f"ucx://{self._host}#peer"))

    def _stop_accepting(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None


class UcxTransport(Transport):
    scheme = "ucx"

    async def listen(self, url: str, on_connection: OnConnection, *, limits: Limits = Limits()) -> UcxListener:
        """Listen on ``ucx://host:port`` (port 0 picks one). UCX listens on every interface."""
        host, port = parse_url(url)
        ucxx = _ucxx()
        listener = UcxListener(host, on_connection, limits)
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
