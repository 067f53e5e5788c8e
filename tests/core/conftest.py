"""tests/core/ holds unit tests of the pure layers: none of them may connect or listen."""

import socket

import pytest


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: socket.socket, *args: object, **kwargs: object) -> None:
        raise AssertionError("a test in tests/core/ tried to connect or listen: it belongs in another folder")

    for name in ("connect", "connect_ex", "bind", "listen"):
        monkeypatch.setattr(socket.socket, name, refuse)
