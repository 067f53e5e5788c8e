"""The handshake's proofs of the shared secret (docs/wire.md#authentication): fresh nonces
and HMAC-SHA256 proofs, with no I/O and no TLS, so that the server's session can use them
without loading a socket. :mod:`rudra_async.security` re-exports them."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from .wire import NONCE_BYTES

_SERVER_LABEL = b"rudra-async v1 server"
_CLIENT_LABEL = b"rudra-async v1 client"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def server_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, _SERVER_LABEL + client_nonce + server_nonce, hashlib.sha256).digest()


def client_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, _CLIENT_LABEL + client_nonce + server_nonce, hashlib.sha256).digest()


def verify(expected: bytes, got: object) -> bool:
    """Constant-time comparison of a proof (anything but bytes of the right length is false)."""
    return isinstance(got, bytes) and hmac.compare_digest(expected, got)
