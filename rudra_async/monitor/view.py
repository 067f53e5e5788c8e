"""``rudra-async status ADDRESS``: a running server seen from a terminal.

It reads ``/status.json`` from the server's ``--metrics`` HTTP endpoint — the snapshot the
status page polls — rather than the Prometheus text or a request on the training port:
one GET gives every figure of the page at one instant (and the recent history), needs
no change to the wire protocol, and keeps watchers off the port learners push gradients
to. The live view is a ``rich`` table redrawn every ``interval`` seconds.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ..errors import ConfigError, ConnectError
from ..logs import escape_controls

SPARK = "▁▂▃▄▅▆▇█"


def status_url(address: str) -> str:
    """The status JSON of a server's metrics ``address`` (``HOST:PORT``, ``PORT`` or a base URL,
    e.g. an application's ``http://host/ps/``)."""
    if address.isdigit():
        address = f"127.0.0.1:{address}"
    if "://" not in address:
        address = "http://" + address
    if not address.startswith(("http://", "https://")):
        raise ConfigError(f"expected HOST:PORT or an http:// URL, got {address!r}")
    try:
        urllib.parse.urlsplit(address).port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        raise ConfigError(f"expected HOST:PORT or an http:// URL, got {address!r}") from None
    if address.endswith("status.json"):
        return address
    return address.rstrip("/") + "/status.json"


def fetch(url: str, timeout: float = 5.0, token: bytes | None = None) -> dict[str, Any]:
    """One snapshot (sending ``token`` as a bearer token, if given), or ConnectError saying why not."""
    request = urllib.request.Request(url, headers={"Authorization": "Bearer " + token.decode()} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            data = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        hint = ": give its token with --token-file" if exc.code == 401 else ""
        raise ConnectError(f"{url} answered {exc.code} {exc.reason}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ConnectError(f"cannot reach {url}: {reason}") from None
    except http.client.HTTPException as exc:  # something that is not an HTTP server (a training port)
        raise ConnectError(f"{url} did not answer HTTP ({type(exc).__name__}): is it the --metrics address?") from None
    except ValueError as exc:
        raise ConnectError(f"{url} did not answer JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConnectError(f"{url} did not answer a status object")
    return data


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 1:
        return "now"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _since(seconds: float) -> str:
    """When something happened, said in words: "just now", "12 s ago"."""
    return "just now" if seconds < 1 else f"{_ago(seconds)} ago"


def _bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def sparkline(values: list[float], width: int = 40) -> str:
    """The last ``width`` values as block characters, scaled to their maximum."""
    values = values[-width:]
    top = max(values, default=0.0)
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] for v in values)


def render(s: dict[str, Any], width: int = 120) -> Any:
    """A ``rich`` renderable of one snapshot for a terminal ``width`` columns wide (the
    peers' addresses are left out below 110)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text.assemble(
        ("rudra-async ", "bold"),
        f"{s['protocol']} · lr policy {s['lr_policy']} · kernel {s['kernel']} · shard {s['shard']} · "
        f"{' '.join(s['server']['addresses'])} · up {_ago(s['uptime_s'])}",
    )
    ckpt = s["checkpoint"]
    cells = [
        ("clock", f"{s['clock']:,}"),
        ("updates/s", f"{s['updates_per_s']:.1f}"),
        (
            "learners λ",
            f"{s['learners_connected']}" + (f" ({s['learners_blocked']} waiting)" if s["learners_blocked"] else ""),
        ),
        ("mean σ", f"{s['staleness_mean']:.2f}"),
        ("applied", f"{s['gradients']:,}"),
        ("dropped, rejected", f"{s['dropped']:,}, {sum(s['rejected'].values()):,}"),
        ("memory (RSS)", _bytes(s.get("rss_bytes"))),
        ("checkpoint", "none" if ckpt["age_s"] is None else f"{_since(ckpt['age_s'])}, {ckpt['failed']} failed"),
    ]
    traffic = Text.assemble(
        ("traffic ", "dim"),
        ", ".join(f"{k} in {_bytes(v['bytes_in'])}, out {_bytes(v['bytes_out'])}" for k, v in s["traffic"].items())
        or "none",
    )
    figures = Table.grid(padding=(0, 2, 0, 0), expand=False)
    for _ in range(3):
        figures.add_column(no_wrap=True, overflow="ellipsis")
    texts = [Text.assemble((label + " ", "dim"), (shown, "bold")) for label, shown in cells]
    for row in range(0, len(texts), 3):
        figures.add_row(*texts[row : row + 3])
    history = s["history"]["updates_per_s"]
    trend = Text.assemble(
        ("updates/s ", "dim"), (sparkline(history), "cyan"), (f"  max {max(history, default=0):.0f}", "dim")
    )

    hist = s["staleness_histogram"]
    total = sum(hist.values()) or 1
    shown = sorted(hist.items(), key=lambda kv: int(kv[0]))[:12]
    staleness = Text.assemble(
        ("staleness σ ", "dim"),
        *[(f"{k}:{100 * v / total:.0f}%  ", "") for k, v in shown],
        ("…" if len(hist) > len(shown) else "", "dim"),
    )

    table = Table(box=box.SIMPLE_HEAD, expand=False, pad_edge=False)
    for col, justify in [
        ("id", "right"),
        ("name", "left"),
        ("state", "left"),
        ("gradients", "right"),
        ("grad/s", "right"),
        ("mean σ", "right"),
        ("dropped", "right"),
        ("last seen", "right"),
        *([("peer", "left")] if width >= 110 else []),
    ]:
        table.add_column(col, justify=justify, no_wrap=True, min_width=len(col), max_width=24)  # type: ignore[arg-type]
    styles = {"training": "green", "waiting": "blue", "slow": "yellow", "left": "dim", "gone": "red"}
    for key in sorted(s["learners"], key=int):
        info = s["learners"][key]
        state = (
            ("left" if info.get("left") == "bye" else "gone")
            if not info["connected"]
            else "slow"
            if info["slow"]
            else "waiting"
            if info["blocked"]
            else "training"
        )
        table.add_row(
            key,
            Text(escape_controls(info["name"]) or "–"),  # a peer's own words: never markup or terminal codes
            Text(state, style=styles[state]),
            f"{info['gradients']:,}",
            f"{info['rate']:.1f}",
            f"{info['staleness_mean']:.2f}",
            f"{info['dropped']:,}",
            _ago(info["last_seen_s"]),
            *([Text(escape_controls(info["peer"]))] if width >= 110 else []),
        )
    parts: list[Any] = [head, figures, traffic, trend, staleness, table]
    if s["rejected"]:
        parts.append(Text("rejected: " + ", ".join(f"{k} {v}" for k, v in s["rejected"].items()), style="yellow"))
    return Group(*parts)


def watch(address: str, interval: float = 1.0, count: int | None = None, token: bytes | None = None) -> None:
    """Redraw the view of ``address`` every ``interval`` seconds (``count`` times, or until Ctrl-C)."""
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    url = status_url(address)
    console = Console()
    with Live(render(fetch(url, token=token), console.width), console=console, auto_refresh=False) as live:
        shown = 1
        try:
            while count is None or shown < count:
                time.sleep(interval)
                try:
                    live.update(render(fetch(url, token=token), console.width), refresh=True)
                except ConnectError as exc:
                    live.update(Text(f"{exc} (retrying every {interval:g} s)", style="red"), refresh=True)
                shown += 1
        except KeyboardInterrupt:
            pass
    if not console.is_terminal:
        console.line()  # the last frame ends its line in a file or a pipe too
