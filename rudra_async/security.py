"""Who may talk to a server: the shared secret (its challenge–response, without I/O, is
:mod:`rudra_async.proofs`, re-exported here), TLS contexts, and which addresses other hosts
can reach.

The handshake (normative description in ``docs/wire.md``): the learner sends AUTH with a
fresh 32-byte nonce N_c; the server answers CHALLENGE with its own fresh nonce N_s only;
the learner proves first, sending PROOF, ``HMAC-SHA256(K, "rudra-async v1 client" ‖ N_c ‖
N_s)``; the server checks it and answers AUTHENTICATED with its own proof,
``HMAC-SHA256(K, "rudra-async v1 server" ‖ N_c ‖ N_s)``, which the learner checks before it
sends anything else (so a server that does not know K is found out before the learner
sends anything of value). Nothing derived from K goes to a peer that has not proved it
knows K, so one exchange gives an attacker no way to test guesses offline. Both
comparisons are constant-time; fresh nonces on both sides make a recorded exchange
worthless on any other connection (no replay), and the two labels keep one side's proof
from ever serving as the other's.
"""

from __future__ import annotations

import collections
import math
import os
import secrets
import ssl
import stat
import weakref
from collections.abc import Mapping

from .addresses import is_loopback_host
from .errors import ConfigError
from .proofs import client_proof, new_nonce, server_proof, verify

__all__ = [
    "MIN_SECRET_BYTES",
    "SECRET_ENV",
    "client_proof",
    "client_tls",
    "is_loopback_host",
    "load_secret",
    "load_token",
    "new_nonce",
    "resolve_secret",
    "server_proof",
    "server_tls",
    "verify",
    "weakness",
    "write_secret",
]

SECRET_ENV = "RUDRA_ASYNC_SECRET"
MIN_SECRET_BYTES = 16
MIN_DISTINCT_BYTES = 8
MIN_ESTIMATED_BITS = 40


def _checked(secret: bytes, source: str) -> bytes:
    """``secret`` stripped of surrounding whitespace, if it is strong enough (:func:`weakness`)."""
    secret = secret.strip()
    why = weakness(secret)
    if why is not None:
        raise ConfigError(f"the secret from {source} is too weak: {why}; make one with `rudra-async secret FILE`")
    return secret


def weakness(secret: bytes) -> str | None:
    """Why ``secret`` is too easy to guess, or None: fewer than :data:`MIN_SECRET_BYTES` bytes;
    fewer than :data:`MIN_DISTINCT_BYTES` different byte values; less than
    :data:`MIN_ESTIMATED_BITS` bits by the estimate length × (Shannon entropy of its byte
    frequencies); or, below 32 bytes, a run of 4 bytes that comes back later ("summer2026summer").
    Random secrets pass (`rudra-async secret` writes 64 hex digits; 16 random hex digits
    fail about once in a hundred, for too few different digits). A dictionary word is not
    found out: use a random secret."""
    if len(secret) < MIN_SECRET_BYTES:
        return f"{len(secret)} bytes, at least {MIN_SECRET_BYTES} are needed"
    counts = collections.Counter(secret)
    if len(counts) < MIN_DISTINCT_BYTES:
        return f"only {len(counts)} different characters, at least {MIN_DISTINCT_BYTES} are needed"
    bits = -sum(c * math.log2(c / len(secret)) for c in counts.values())
    if bits < MIN_ESTIMATED_BITS:
        return f"about {bits:.0f} bits of variety, at least {MIN_ESTIMATED_BITS} are needed (a longer, random secret)"
    if len(secret) < 32:
        first: dict[bytes, int] = {}
        for i in range(len(secret) - 3):
            seen = first.setdefault(secret[i : i + 4], i)
            if i - seen >= 4:
                return f"{secret[i : i + 4]!r} comes back in it (a pattern); use a random secret"
    return None


def write_secret(path: str) -> None:
    """Write a new random secret (32 random bytes as 64 hex digits) to ``path``, readable by
    its owner only (mode 0600); ConfigError if ``path`` exists (it is never overwritten)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} exists: remove it first (a secret is never overwritten)") from None
    except OSError as exc:
        raise ConfigError(f"cannot create {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32) + "\n")


def load_secret(path: str | None = None, env: Mapping[str, str] | None = None) -> bytes | None:
    """The shared secret: the contents of ``path`` (``--secret-file``; surrounding
    whitespace stripped) if given, else the ``RUDRA_ASYNC_SECRET`` environment variable,
    else None. A weak secret (:func:`weakness`) is refused, a file others may read is warned
    about. Never taken from a flag's value."""
    if path:
        try:
            with open(path, "rb") as fh:
                mode = os.fstat(fh.fileno()).st_mode
                data = fh.read(1 << 16)
        except OSError as exc:
            raise ConfigError(f"cannot read the secret file {path}: {exc.strerror or exc}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            import logging

            logging.getLogger(__name__).warning("secret file %s can be read by other users (chmod 600 it)", path)
        return _checked(data, path)
    value = (os.environ if env is None else env).get(SECRET_ENV)
    if value:
        return _checked(value.encode(), SECRET_ENV)
    return None


def load_token(path: str) -> bytes:
    """A bearer token (``--metrics-token-file``, ``--token-file``): the file's contents,
    stripped, held to the rules of a secret (:func:`weakness`)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(1 << 16)
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {path}: {exc.strerror or exc}") from None
    return _checked(data, path)


def resolve_secret(secret: bytes | str | None, path: str | None = None) -> bytes | None:
    """The secret an API call uses: ``secret`` when given (bytes or text), else
    :func:`load_secret` of ``path`` and the environment."""
    if secret is not None:
        return _checked(secret.encode() if isinstance(secret, str) else bytes(secret), "the secret argument")
    return load_secret(path)


# -- TLS --------------------------------------------------------------------------------------
def server_tls(cert: str, key: str | None = None, client_ca: str | None = None) -> ssl.SSLContext:
    """A server context (TLS 1.2+): ``cert``/``key`` (PEM) identify the server; with
    ``client_ca`` every learner must present a certificate signed by it."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, cert, key)
    if client_ca:
        _load_ca(ctx, client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_tls(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """A learner's context: the server's certificate must be signed by ``ca`` and name the
    host connected to; ``cert``/``key`` (PEM): a client certificate, for servers that ask."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_ca(ctx, ca)
    if cert:
        _load_chain(ctx, cert, key)
        _WITH_CERTIFICATE.add(ctx)
    elif key:
        raise ConfigError("--tls-key needs --tls-cert")
    return ctx


#: the client contexts :func:`client_tls` gave a certificate (ssl has no way to ask a context)
_WITH_CERTIFICATE: weakref.WeakSet[ssl.SSLContext] = weakref.WeakSet()


def has_client_certificate(ctx: ssl.SSLContext) -> bool:
    """Whether ``ctx`` was made by :func:`client_tls` with a client certificate."""
    return ctx in _WITH_CERTIFICATE


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str | None) -> None:
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS certificate {cert} (key {key or cert}): {exc}") from None


def _load_ca(ctx: ssl.SSLContext, ca: str) -> None:
    try:
        ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS CA file {ca}: {exc}") from None
