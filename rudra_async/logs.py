"""Logging: one logger per module (``logging.getLogger(__name__)``), set up by the command
line as text or JSON lines, and a rate limit for messages a peer can provoke.

- :func:`configure`: the root handler for ``--log-level`` and ``--log-format text|json``.
- :class:`TextFormatter`: one line per record (``TEXT_FORMAT``); control characters in the
  message (a peer's name may carry a newline) are escaped, and a backslash doubled, so no
  one can forge a line or make two messages read alike; a traceback's lines are indented.
- :class:`JsonFormatter`: one JSON object per line: ``time`` (UTC, ISO 8601), ``level``,
  ``logger``, ``message``, the fields passed with ``extra=`` (``learner``, ``peer``, ``code``,
  …), and ``exception`` when there is one.
- :func:`rate_limited`: gives a logger a :class:`RateLimit`, so repeated messages (hostile
  input answered with the same refusal thousands of times a second) cannot flood the log.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: the attributes every LogRecord has; anything else on a record came with ``extra=``
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


#: control characters (C0, DEL, C1) and the Unicode line and paragraph separators, and the
#: backslash (doubled, so an escape and the same characters typed by a peer read differently)
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))} | {
    0x2028: "\\u2028",
    0x2029: "\\u2029",
    0x5C: "\\\\",
}
#: what starts each line of a traceback in a text log: no traceback line looks like a record
TRACEBACK_INDENT = "  | "


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, its message with control characters escaped; a traceback (or stack)
    follows, each of its lines after :data:`TRACEBACK_INDENT`, escaped the same way (an
    exception's message may quote a peer)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        cached = record.exc_text  # another handler's rendering, unescaped; or all a record sent over has
        record.exc_text = None if record.exc_info or not cached else _indented(cached)
        try:
            return super().format(record)
        finally:
            record.exc_text = cached

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def escape_controls(text: str) -> str:
    """``text`` with its control characters written as escapes (``\\xNN``, ``\\u2028``) and
    its backslashes doubled: one line, printable, and unambiguous."""
    return text.translate(_CONTROL)


def _indented(text: str) -> str:
    """Each line of ``text`` escaped and after :data:`TRACEBACK_INDENT`."""
    return "\n".join(TRACEBACK_INDENT + escape_controls(line) for line in text.split("\n"))


class JsonFormatter(logging.Formatter):
    """A record as one JSON object on one line (see the module docstring for the keys)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level: str = "INFO", fmt: str = "text") -> None:
    """Log to stderr at ``level`` as ``fmt`` (``text`` or ``json``), unless logging was set up
    already (``logging.basicConfig``'s rule: an embedding program's own setup stays)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level, handlers=[handler])


class RateLimit(logging.Filter):
    """Lets through at most ``burst`` records of one kind (logger, level and message
    template) per ``window`` seconds. The first record let through after some were
    suppressed says how many (and carries ``suppressed=N``). DEBUG records are never
    limited. Keys are message templates, so their number is bounded by the code."""

    def __init__(self, burst: int = 20, window: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst, self.window, self.clock = burst, window, clock
        self._kinds: dict[tuple[str, int, str], list[float]] = {}  # key -> [window start, passed, suppressed]

    def reset(self) -> None:
        """Forget every kind seen (a fresh budget for each)."""
        self._kinds.clear()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG:
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        state = self._kinds.get(key)
        if state is None or now - state[0] >= self.window:
            suppressed = int(state[2]) if state else 0
            if len(self._kinds) >= 1000 and state is None:
                self._kinds.clear()  # bounded, whatever templates come
            self._kinds[key] = state = [now, 0, 0]
            if suppressed:
                record.msg = f"{record.getMessage()} [{suppressed} similar messages suppressed]"
                record.args = None
                record.suppressed = suppressed
        if state[1] >= self.burst:
            state[2] += 1
            return False
        state[1] += 1
        return True


def rate_limited(logger: logging.Logger, limit: RateLimit | None = None) -> logging.Logger:
    """``logger`` with a :class:`RateLimit` (a shared default one unless given)."""
    logger.addFilter(limit or DEFAULT_LIMIT)
    return logger


DEFAULT_LIMIT = RateLimit()
