"""Run statistics of the server shell: traffic per transport."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..transports.base import Connection


class Traffic:
    """Bytes received and sent per transport scheme: the connections' own counts
    (:attr:`~rudra_async.transports.base.Connection.bytes_in`/``bytes_out``), those of
    open connections read when asked, those of closed ones kept."""

    def __init__(self) -> None:
        self._closed: dict[str, list[int]] = {}
        self._open: dict[Connection, str] = {}

    @contextlib.contextmanager
    def track(self, scheme: str, conn: Connection) -> Iterator[None]:
        """Count ``conn`` under ``scheme`` while the block runs, and keep its count after."""
        self._open[conn] = scheme
        self._closed.setdefault(scheme, [0, 0])
        try:
            yield
        finally:
            del self._open[conn]
            kept = self._closed[scheme]
            kept[0] += conn.bytes_in
            kept[1] += conn.bytes_out

    def totals(self) -> dict[str, dict[str, int]]:
        """``{scheme: {"bytes_in": n, "bytes_out": n}}`` over every connection so far."""
        out = {scheme: [b_in, b_out] for scheme, (b_in, b_out) in self._closed.items()}
        for conn, scheme in self._open.items():
            out[scheme][0] += conn.bytes_in
            out[scheme][1] += conn.bytes_out
        return {scheme: {"bytes_in": b_in, "bytes_out": b_out} for scheme, (b_in, b_out) in out.items()}
