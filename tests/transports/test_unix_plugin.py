"""The example plugin's ``unix://`` transport (plugins/rudra-async-example), written from
docs/transports.md alone: it passes the conformance suite, its blocking side included, and a
run trains over it without ``--insecure`` (a Unix socket reaches only this host)."""

from __future__ import annotations

import json
import os

import pytest
from helpers import run_cli
from rudra_async_example.unix import UnixTransport, socket_path

from rudra_async import transports
from rudra_async.errors import ConfigError
from rudra_async.testing import check_transport
from rudra_async.transports.blocking import BlockingConnection


async def test_the_unix_plugin_passes_the_conformance_suite_blocking_side_included():
    url = UnixTransport().fresh_address()
    ran = await check_transport(url)
    assert "blocking_connection" in ran and "authentication" in ran and "peer_killed_mid_frame" in ran
    assert not os.path.exists(socket_path(url))  # the listener took its socket file with it


def test_the_plugin_is_found_by_scheme_and_declares_what_it_is():
    unix = transports.transport_for("unix:///tmp/x.sock")
    assert isinstance(unix, UnixTransport) and "unix" in transports.known_schemes()
    assert transports.is_loopback("unix:///tmp/x.sock") and not unix.supports_tls
    for bad in ("unix://relative.sock", "unix://host/x.sock", f"unix:///{'x' * 200}"):
        with pytest.raises(ConfigError):
            socket_path(bad)


def test_train_runs_over_the_unix_plugin_without_insecure(tmp_path):
    out = tmp_path / "r.json"
    proc = run_cli(
        "train", "--transport", "unix", "-l", "2", "--epochs", "1", "--quiet", "--results", str(out), timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    assert "insecure" not in proc.stderr and "not encrypted" not in proc.stderr
    result = json.loads(out.read_text())
    assert result["updates"] > 0 and set(result["per_learner"]) == {"0", "1"}
    assert result["transport"] == "unix" and result["test_accuracy"] > 0.5


async def test_the_suite_fails_a_blocking_side_that_loses_metadata():
    """The blocking check is real: a blocking connection that drops what a frame's metadata
    says fails it, naming the blocking side."""

    class Forgetful(BlockingConnection):
        async def send(self, msg_type, meta=None, arrays=()):
            await super().send(msg_type, {}, arrays)

    class Planted(UnixTransport):
        def connect_blocking(self, url, **kwargs):
            conn = super().connect_blocking(url, **kwargs)
            conn.__class__ = Forgetful
            return conn

    with pytest.raises(AssertionError, match="blocking side"):
        await check_transport(UnixTransport().fresh_address(), transport=Planted(), only=("blocking_connection",))
