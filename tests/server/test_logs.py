"""Logs: JSON lines on request, per-learner join/gone/slow messages, and a rate limit that
keeps hostile input from flooding the log."""

import asyncio
import json
import logging
import signal
import sys

import numpy as np
from helpers import free_port, initial_weights, reap, run_server, small_layout, start_cli, wait_listening

from rudra_async.client import Client
from rudra_async.logs import TEXT_FORMAT, TRACEBACK_INDENT, JsonFormatter, RateLimit, TextFormatter


def record(msg: str, *args, level=logging.WARNING, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("rudra_async.server.session", level, __file__, 1, msg, args, None)
    rec.__dict__.update(extra)
    return rec


def test_json_lines_carry_the_message_and_the_extra_fields():
    line = JsonFormatter().format(record("rejected input from %s: [%s]", "tcp://x:1", "bad_shape", code="bad_shape"))
    out = json.loads(line)
    assert out["level"] == "WARNING" and out["logger"] == "rudra_async.server.session"
    assert out["message"] == "rejected input from tcp://x:1: [bad_shape]" and out["code"] == "bad_shape"
    assert out["time"].endswith("+00:00")


def test_the_rate_limit_lets_a_burst_through_then_counts_what_it_suppressed():
    now = [0.0]
    limit = RateLimit(burst=3, window=10.0, clock=lambda: now[0])
    passed = [limit.filter(record("rejected input from %s", i)) for i in range(100)]
    assert passed == [True] * 3 + [False] * 97
    assert limit.filter(record("another kind of message"))  # each kind has its own budget
    assert limit.filter(record("rejected input from %s", 0, level=logging.DEBUG))  # never limited
    now[0] = 10.0
    rec = record("rejected input from %s", "tcp://y:2")
    assert limit.filter(rec)
    assert rec.getMessage() == "rejected input from tcp://y:2 [97 similar messages suppressed]"
    assert rec.suppressed == 97


async def test_a_flood_of_bad_requests_leaves_a_few_log_lines(caplog):
    layout = small_layout()
    caplog.set_level(logging.INFO, logger="rudra_async.server")
    async with run_server(kernel="numpy") as ps:
        client = await Client.connect(ps.addresses[0], layout, initial_weights(layout))
        bad = np.zeros(layout.size + 1, np.float32)
        for _ in range(300):
            try:
                await client.push(bad, 0)
            except Exception:
                pass
        await client.close()
        assert ps.stats()["rejected"] == {"bad_shape": 300}  # every refusal is counted ...
    lines = [r for r in caplog.records if "rejected input" in r.getMessage()]
    assert len(lines) <= 20  # ... but the log holds a bounded number of lines


async def test_learners_joining_vanishing_and_going_silent_are_logged(caplog):
    layout = small_layout()
    caplog.set_level(logging.INFO, logger="rudra_async.server")  # `train` and `study` quiet it in-process
    async with run_server(kernel="numpy", slow_after=0.3) as ps:
        quiet = await Client.connect(ps.addresses[0], layout, initial_weights(layout), name="quiet")
        crash = await Client.connect(ps.addresses[0], layout, name="crash")
        crash.conn.close()  # no bye
        await asyncio.sleep(1.0)  # the watch looks every slow_after/4 seconds
        await quiet.pull()
        await asyncio.sleep(0.05)
        await quiet.close()
    messages = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("rudra_async.server")]
    assert any(
        level == "INFO" and text.startswith("learner 0 (quiet) joined from tcp://127.0.0.1:")
        for level, text in messages
    )
    assert (
        "WARNING",
        "learner 1 (crash) is gone: its connection ended without a bye (0 gradients applied)",
    ) in messages
    assert ("WARNING", "learner 0 (quiet) is slow: nothing from it for 0.3 s") in messages
    assert ("INFO", "learner 0 (quiet) is back") in messages
    assert ("INFO", "learner 0 (quiet) left") in messages
    slow = next(r for r in caplog.records if "is slow" in r.getMessage())
    assert (slow.learner, slow.learner_name) == (0, "quiet")  # fields for --log-format json


def test_log_format_json_from_the_command_line():
    port = free_port()
    server = start_cli("--log-format", "json", "server", "--listen", f"tcp://127.0.0.1:{port}", "--kernel", "numpy")
    try:
        wait_listening(port)
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=30)
    finally:
        reap(server)
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{") and '"level"' in line]
    assert any(line["message"].startswith("parameter server listening on") for line in lines), err


async def test_a_learner_name_cannot_forge_a_line_of_the_text_log():
    """Text logs are one line per record: a control character in a message (a learner may
    name itself anything) is escaped, so a name cannot start a line of its own."""
    port = free_port()
    server = start_cli("server", "--listen", f"tcp://127.0.0.1:{port}", "--kernel", "numpy")
    try:
        await asyncio.to_thread(wait_listening, port)
        layout = small_layout()
        forged = "x\n2026-12-05 00:00:00,000 ERROR rudra_async.server: FORGED\r\u2028"
        client = await Client.connect(f"tcp://127.0.0.1:{port}", layout, initial_weights(layout), name=forged)
        await client.close()
        await asyncio.sleep(0.2)
        server.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(server.communicate, timeout=30)
    finally:
        reap(server)
    assert "(x\\x0a2026-12-05 00:00:00,000 ERROR rudra_async.server: FORGED\\x0d\\u2028)" in err
    logged = [line for line in err.splitlines() if "FORGED" in line and not line.startswith("{")]  # not the stats
    assert len(logged) == 2 and all("(x\\x0a" in line for line in logged), err  # joined, left: never a line of its own
    assert "\u2028" not in err


def _text(record: logging.LogRecord) -> str:
    return TextFormatter().format(record)


def test_a_backslash_is_doubled_so_an_escape_cannot_be_typed():
    """A peer that types the four characters of an escape reads differently from one that
    sent the control character."""
    typed = _text(logging.LogRecord("rudra_async.test", logging.INFO, __file__, 1, "name %s", ("x\\x0ay",), None))
    sent = _text(logging.LogRecord("rudra_async.test", logging.INFO, __file__, 1, "name %s", ("x\ny",), None))
    assert typed.endswith("name x\\\\x0ay") and sent.endswith("name x\\x0ay")


def test_a_traceback_quoting_a_peer_cannot_forge_a_line():
    """Each traceback line is indented and escaped: an exception message with a newline (it
    may quote a peer) never starts a line that reads as a record of its own."""
    forged = "bad name x\n2026-12-05 00:00:00,000 ERROR rudra_async.server: FORGED\r"
    try:
        raise ValueError(forged)
    except ValueError:
        record = logging.LogRecord("rudra_async.test", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    plain = logging.Formatter(TEXT_FORMAT).format(record)  # another handler renders it first
    assert "\n2026-12-05" in plain
    sent_over = logging.makeLogRecord({**vars(record), "exc_info": None})  # as a SocketHandler's peer gets it
    assert _text(sent_over) == _text(record)
    lines = _text(record).split("\n")
    assert lines[0].endswith("ERROR rudra_async.test: failed")
    assert all(line.startswith(TRACEBACK_INDENT) for line in lines[1:]) and len(lines) > 3
    assert lines[-2:] == [
        TRACEBACK_INDENT + "ValueError: bad name x",
        TRACEBACK_INDENT + "2026-12-05 00:00:00,000 ERROR rudra_async.server: FORGED\\x0d",
    ]
