"""Watching a running server: /metrics scraped and parsed while learners train, agreeing
with ps.stats(); the status JSON and the live view of `rudra-async status`; the HTTP
endpoint's answers to bad requests; traffic counted at both ends."""

import asyncio
import io
import json
import logging
import time

import numpy as np
import pytest
from helpers import (
    CLI_ARGS,
    free_port,
    http_get,
    initial_weights,
    numpy_learner,
    reap,
    run_server,
    small_layout,
    start_server,
    subprocess_env,
)
from prometheus_client.parser import text_string_to_metric_families

from rudra_async import RemoteError
from rudra_async.client import Client
from rudra_async.monitor.collector import STALENESS_BUCKETS
from rudra_async.monitor.http import RENDER_EVERY_S, HttpServer
from rudra_async.monitor.view import render
from rudra_async.server.core import REFUSAL_CODES


def samples(text: str) -> dict:
    """{(sample name, frozenset of labels): value} of a Prometheus exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(parsed: dict, sample: str, **labels) -> float:
    return parsed[(sample, frozenset(labels.items()))]


def check_agreement(parsed: dict, stats: dict, connected: int) -> None:
    """Every figure of the exposition is the one ps.stats() gives."""
    assert value(parsed, "rudra_clock") == stats["updates"]
    assert value(parsed, "rudra_gradients_applied_total") == stats["gradients"]
    assert value(parsed, "rudra_gradients_dropped_total") == stats["dropped"]
    assert value(parsed, "rudra_samples_total") == stats["samples"]
    assert value(parsed, "rudra_update_seconds_total") == pytest.approx(stats["update_seconds"])
    assert value(parsed, "rudra_learners") == connected
    assert (
        value(parsed, "rudra_gradient_buffers_in_use") == value(parsed, "rudra_gradient_buffers_waiting") == 0
    )  # idle
    rejected = {dict(labels)["code"]: v for (name, labels), v in parsed.items() if name == "rudra_rejected_total"}
    assert rejected == {**dict.fromkeys(REFUSAL_CODES, 0), **stats["rejected"]}  # every code, from zero
    histogram = {int(s): c for s, c in stats["staleness_histogram"].items()}
    for bound in STALENESS_BUCKETS:
        expected = sum(c for s, c in histogram.items() if s <= bound)
        assert value(parsed, "rudra_staleness_bucket", le=f"{float(bound)}") == expected, bound
    assert value(parsed, "rudra_staleness_bucket", le="+Inf") == stats["gradients"]
    assert value(parsed, "rudra_staleness_count") == stats["gradients"]
    assert value(parsed, "rudra_staleness_sum") == sum(s * c for s, c in histogram.items())
    for key, info in stats["learners"].items():
        labels = {"learner": key, "name": info["name"]}
        assert value(parsed, "rudra_learner_gradients_total", **labels) == info["gradients"]
        assert value(parsed, "rudra_learner_dropped_total", **labels) == info["dropped"]
        assert value(parsed, "rudra_learner_staleness_mean", **labels) == pytest.approx(info["staleness_mean"])
        assert value(parsed, "rudra_learner_connected", **labels) == info["connected"]
        seen = value(parsed, "rudra_learner_last_seen_timestamp_seconds", **labels)
        assert abs(time.time() - info["last_seen_s"] - seen) < 5  # a Unix time, not an age
    traffic = stats["traffic"]["tcp"]
    assert value(parsed, "rudra_transport_received_bytes_total", transport="tcp") == traffic["bytes_in"]
    assert value(parsed, "rudra_transport_sent_bytes_total", transport="tcp") == traffic["bytes_out"]


@pytest.mark.parametrize(
    "protocol, options", [("async", {}), ("backup", {"backup": 1})], ids=["async-staleness", "backup-drops"]
)
async def test_metrics_scraped_while_learners_train_agree_with_stats(protocol, options):
    layout = small_layout()
    w0 = initial_weights(layout)
    async with run_server(
        protocol=protocol, **options, kernel="numpy", max_updates=150, metrics="127.0.0.1:0", checkpoint=None
    ) as ps:
        url = ps.monitor.url
        clients = [await Client.connect(ps.addresses[0], layout, w0, name=f"learner-{i}") for i in range(3)]
        for c in clients:  # refused requests, counted by code
            with pytest.raises(RemoteError) as refused:
                await c.push(np.zeros(layout.size, np.float32), 10**6)
            assert refused.value.code == "bad_timestamp"
        with pytest.raises(RemoteError) as refused:
            await clients[0].push(np.full(layout.size, np.nan, np.float32), 0)
        assert refused.value.code == "bad_gradient"
        for c in clients:
            await c.close()
        learners = [
            asyncio.create_task(numpy_learner(ps.addresses[0], layout, w0, delay=0.01, name=f"learner-{i}", seed=i))
            for i in range(3)
        ]
        while ps.clock < 40:  # training: scrape over HTTP, and compare at one instant
            await asyncio.sleep(0.02)
        status, headers, body = await http_get(url + "/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain")
        during = samples(body.decode())
        assert value(during, "rudra_clock") >= 40 and value(during, "rudra_learners") == 3
        assert value(during, "process_resident_memory_bytes") > 10e6
        check_agreement(samples(ps.monitor.metrics().decode()), ps.stats(), connected=3)  # no await between
        clients = await asyncio.gather(*learners)  # the server stopped them at 150 updates; still connected
        await asyncio.sleep(RENDER_EVERY_S)  # the answer rendered during training is not reused
        status, _, body = await http_get(url + "/metrics")
        stats = ps.stats()
        parsed = samples(body.decode())
        check_agreement(parsed, stats, connected=3)
        assert stats["updates"] == 150 and stats["rejected"]["bad_timestamp"] == 3
        assert stats["rejected"]["bad_gradient"] == 1
        if protocol == "backup":
            assert stats["dropped"] > 0  # the late gradient of each round
        else:
            assert stats["staleness_max"] >= 1  # three learners overlap
        for c in clients:
            await c.close()


async def test_the_http_endpoint_answers_only_what_it_serves():
    async with run_server(kernel="numpy", metrics="127.0.0.1:0") as ps:
        url = ps.monitor.url
        status, headers, body = await http_get(url + "/")
        assert status == 200 and headers["content-type"].startswith("text/html")
        assert (
            b"<svg" in body
            and b"status.json" in body
            and b"http" not in body.split(b"<script>")[1].replace(b"http://www.w3.org/2000/svg", b"")
        )  # no asset is fetched from anywhere
        status, headers, body = await http_get(url + "/status.json?x=1")
        assert status == 200 and json.loads(body)["clock"] == 0
        assert (await http_get(url + "/metrics", method="HEAD"))[2] == b""
        assert (await http_get(url + "/nothing"))[0] == 404
        assert (await http_get(url + "/metrics", method="POST"))[0] == 405
        reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
        writer.write(b"GET /" + b"x" * 20000 + b" HTTP/1.1\r\n\r\n")  # larger than any request we read
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 400")


async def test_idle_connections_cannot_lock_scrapers_out_nor_spoil_the_close(caplog):
    """Every slot held by a connection that sends nothing: a scraper still gets its answer
    (the oldest idle one makes room); a malformed target is a 400, not a logged error; and
    closing the server with idle clients connected logs no error."""
    from rudra_async.monitor.http import MAX_CONNECTIONS

    async with run_server(kernel="numpy", metrics="127.0.0.1:0") as ps:
        url = ps.monitor.url
        host, port = url.removeprefix("http://").split(":")
        idle = [await asyncio.open_connection(host, port) for _ in range(MAX_CONNECTIONS)]
        http = ps.monitor._http
        for _ in range(100):  # until every one holds a slot
            if len(http._tasks) == MAX_CONNECTIONS:
                break
            await asyncio.sleep(0.05)
        assert len(http._tasks) == MAX_CONNECTIONS
        status, _, body = await http_get(url + "/metrics")
        assert status == 200 and b"rudra_clock" in body
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET http://[ HTTP/1.1\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 400")
        idle.append(await asyncio.open_connection(host, port))
        await asyncio.sleep(0.1)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    for _, w in idle:
        w.close()


async def test_a_page_fetched_in_a_loop_is_rendered_at_most_once_per_interval():
    """Requests for a page within RENDER_EVERY_S of its rendering get the same bytes without
    rendering it again (a client fetching in a loop costs the loop little); later ones get a
    fresh answer; a 404 is never kept, so arbitrary paths cannot grow the server's memory."""
    rendered = []

    def route(path):
        rendered.append(path)
        if path == "/missing" or path.startswith("/x"):
            return 404, "text/plain", b"not found\n"
        return 200, "text/plain", f"render {len(rendered)}".encode()

    http = HttpServer(route)
    await http.start("127.0.0.1", 0)
    try:
        answers = [(await http_get(http.url + "/page"))[2] for _ in range(5)]
        if len(rendered) == 1:  # all within the interval (a slow host may cross it once)
            assert answers == [b"render 1"] * 5
        assert len(rendered) <= 2 and set(answers) <= {b"render 1", b"render 2"}
        await asyncio.sleep(RENDER_EVERY_S)
        before = len(rendered)
        assert (await http_get(http.url + "/page"))[2] == f"render {before + 1}".encode()
        for i in range(3):
            assert (await http_get(http.url + "/missing"))[0] == 404
            assert (await http_get(http.url + f"/x{i}"))[0] == 404
        assert rendered[-6:] == ["/missing", "/x0", "/missing", "/x1", "/missing", "/x2"]  # each rendered
        assert list(http._rendered) == ["/page"]
    finally:
        await http.close()


async def test_bytes_are_counted_at_both_ends_of_every_connection():
    layout = small_layout()
    async with run_server(kernel="numpy") as ps:
        client = await numpy_learner(ps.addresses[0], layout, initial_weights(layout), steps=20)
        await client.close()  # a bye and its answer: both ends have seen every byte
        for _ in range(100):
            if not ps.traffic._open:
                break
            await asyncio.sleep(0.01)
        sent, received = client.conn.bytes_out, client.conn.bytes_in
        assert sent > 21 * layout.nbytes and received > 21 * layout.nbytes  # 20 gradients, 21 weights
        assert ps.stats()["traffic"] == {"tcp": {"bytes_in": sent, "bytes_out": received}}


async def run_command(*args: str, timeout: float = 60) -> tuple[int, str, str]:
    """``rudra-async ARGS`` as a subprocess, without blocking this event loop."""
    proc = await asyncio.create_subprocess_exec(
        *CLI_ARGS, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=subprocess_env()
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out.decode(), err.decode()


def shown(snapshot: dict) -> str:
    """What the live view prints for ``snapshot``, 120 columns wide."""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=120)
    console.print(render(snapshot, 120))
    return console.file.getvalue()


async def test_status_json_and_live_view_of_a_server_started_with_metrics():
    port, metrics = free_port(), free_port()
    server = await asyncio.to_thread(
        start_server, port, "--kernel", "numpy", "--max-updates", "60", "--metrics", f"127.0.0.1:{metrics}"
    )
    try:
        layout = small_layout()
        url = f"tcp://127.0.0.1:{port}"
        clients = await asyncio.gather(
            *(numpy_learner(url, layout, initial_weights(layout), name=f"learner-{i}", seed=i) for i in range(2))
        )
        code, out, err = await run_command("status", f"127.0.0.1:{metrics}", "--json")
        assert code == 0, err
        snap = json.loads(out)
        assert snap["clock"] == snap["updates"] == 60 and snap["learners_connected"] == 2
        assert sum(v["gradients"] for v in snap["learners"].values()) == 60
        assert {v["name"] for v in snap["learners"].values()} == {"learner-0", "learner-1"}
        assert snap["history"]["clock"] and snap["rss_bytes"] > 0 and snap["traffic"]["tcp"]["bytes_in"] > 0
        first = next(iter(snap["learners"].values()))
        first["name"], first["peer"] = "job[/][bold]x\x1b[2J", "tcp://[::1]:1"  # a learner's own words
        assert "job[/][bold]x\\x1b[2J" in shown(snap) and "tcp://[::1]:1" in shown(snap)
        code, out, err = await run_command("status", str(port), "--json")  # the training port, by mistake
        assert code == 2 and "did not answer HTTP" in err and "Traceback" not in err, err
        code, out, err = await run_command("status", "abc:def")
        assert code == 2 and "expected HOST:PORT" in err and "Traceback" not in err, err
        code, out, err = await run_command(
            "status", f"http://127.0.0.1:{metrics}/", "--count", "2", "--interval", "0.2"
        )
        assert code == 0, err
        for text in ("clock", "60", "updates/s", "learner-0", "learner-1", "training", "mean σ"):
            assert text in out, (text, out)
        for c in clients:
            await c.close()
    finally:
        reap(server)
    code, out, err = await run_command("status", f"127.0.0.1:{metrics}", "--json")
    assert code == 2 and "cannot reach" in err and "Traceback" not in err


def test_metrics_need_a_valid_address():
    from rudra_async.config import ServerConfig
    from rudra_async.errors import ConfigError

    with pytest.raises(ConfigError, match="--metrics needs HOST:PORT or PORT"):
        ServerConfig(metrics="localhost:http").validate()


async def test_after_the_learners_left_the_status_says_so_and_shows_no_rate(tmp_path):
    """Learners that left with a bye showed a red "gone" like a crash; with λ = 0 the page
    still showed the last ten seconds' updates/s; the status command said "now ago"."""
    layout = small_layout()
    path = str(tmp_path / "run.ckpt")
    async with run_server(kernel="numpy", metrics="127.0.0.1:0", checkpoint=path) as ps:
        stayed = await numpy_learner(ps.addresses[0], layout, initial_weights(layout), steps=30, name="stays")
        left = await numpy_learner(ps.addresses[0], layout, initial_weights(layout), steps=30, name="leaves")
        await left.close()  # with a bye
        await ps.checkpoint(path)
        snap = ps.monitor.status()
        states = {v["name"]: v["left"] for v in snap["learners"].values()}
        assert states == {"stays": None, "leaves": "bye"}
        text = shown(snap)
        assert "left" in text and "gone" not in text and "just now" in text and "now ago" not in text
        assert snap["updates_per_s"] > 0  # one learner still connected: the trailing rate stands
        stayed.conn.close()  # lost, no bye
        await asyncio.sleep(ps.monitor.interval + 0.3)
        snap = ps.monitor.status()
        assert {v["name"]: v["left"] for v in snap["learners"].values()} == {"stays": "lost", "leaves": "bye"}
        assert snap["learners_connected"] == 0 and snap["updates_per_s"] == 0.0
        assert "gone" in shown(snap)
