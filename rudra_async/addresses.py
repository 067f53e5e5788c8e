"""What an address says, without I/O: ``scheme://host:port`` parsed and written, and
whether a host is one only this machine can reach."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from .errors import ConfigError


def is_loopback_host(host: str) -> bool:
    """Whether only this host can reach ``host``: a loopback address or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_host_port(url: str, scheme: str) -> tuple[str, int]:
    """``scheme://host:port`` (IPv6 in brackets) → (host, port), or a ConfigError saying why."""
    parts = urlsplit(url)
    if parts.scheme != scheme:
        raise ConfigError(f"not a {scheme}:// address: {url!r}")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"bad port in {url!r}") from None
    if not parts.hostname or port is None:
        raise ConfigError(f"address {url!r} needs a host and a port, e.g. {scheme}://127.0.0.1:7000")
    if parts.path.strip("/") or parts.query or parts.fragment or parts.username is not None:
        raise ConfigError(f"address {url!r} has more than a host and a port, e.g. {scheme}://127.0.0.1:7000")
    return parts.hostname, port


def format_host_port(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
