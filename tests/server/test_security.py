"""Safe on a shared network: the secret on the command line and in the API, the refusal to
expose a server without one, TLS with throw-away certificates, clear client errors."""

import asyncio
import contextlib
import signal

import numpy as np
import pytest
from helpers import (
    free_port,
    initial_weights,
    make_pki,
    read_frame,
    reap,
    run_cli,
    run_server,
    small_layout,
    start_cli,
    start_server,
)

from rudra_async import checkpoint, security, transports
from rudra_async.client import Client, SyncClient
from rudra_async.config import ServerConfig
from rudra_async.errors import ConfigError, ConnectError, RemoteError
from rudra_async.server import ParameterServer
from rudra_async.wire import MsgType, encode_frame

LAYOUT = small_layout()
SECRET = "correct horse battery staple"


def raw(msg_type, meta, arrays=()):
    return b"".join(bytes(p) for p in encode_frame(msg_type, meta, arrays))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A throw-away CA, a server/client certificate for 127.0.0.1 signed by it, an expired
    one, and an unrelated CA (openssl on the PATH)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_server(pki, cert="host.pem", client_ca=None, **kw):
    cfg = ServerConfig(listen=["tcp://127.0.0.1:0"], kernel="numpy", tls_cert=pki[cert], tls_key=pki["host.key"], **kw)
    if client_ca:
        cfg.tls_client_ca = pki[client_ca]
    return ParameterServer(cfg)


async def train_briefly(url, **kw):
    client = await Client.connect(url, LAYOUT, initial_weights(LAYOUT), timeout=5, **kw)
    w = await client.pull()
    for _ in range(3):
        w = await client.push_pull(np.ones(LAYOUT.size, np.float32), w.timestamp)
    await client.close()
    return w.timestamp


async def test_tls_trains_and_every_misconfiguration_is_a_clear_error(pki):
    async with tls_server(pki) as ps:
        url = ps.addresses[0]
        assert await train_briefly(url, tls=security.client_tls(pki["ca.pem"])) == 3
        with pytest.raises(ConnectError, match="certificate verify failed"):
            await train_briefly(url, tls=security.client_tls(pki["other-ca.pem"]))
        with pytest.raises(ConnectError, match=r"closed the connection before its WELCOME.*TLS"):
            await train_briefly(url)  # plain text against a TLS server
    async with tls_server(pki, cert="expired.pem") as ps:
        with pytest.raises(ConnectError, match="certificate has expired"):
            await train_briefly(ps.addresses[0], tls=security.client_tls(pki["ca.pem"]))
    async with run_server(kernel="numpy") as ps:  # TLS against a plain server
        with pytest.raises(ConnectError, match="TLS"):
            await train_briefly(ps.addresses[0], tls=security.client_tls(pki["ca.pem"]))


async def test_tls_frames_are_never_written_by_a_sender_thread(pki, send_threads):
    """A sender thread writes to the raw socket, under the TLS layer: over TLS every frame
    goes through the loop, whatever its size (a raw write would break the session)."""
    send_threads(1)
    async with tls_server(pki) as ps:
        assert await train_briefly(ps.addresses[0], tls=security.client_tls(pki["ca.pem"])) == 3
    assert send_threads.calls == []


async def test_a_blocking_client_over_tls_trains_and_never_busy_polls(pki):
    """The blocking client over TLS (``recv_into`` with flags is refused on a TLS socket, so
    its first read after a send must not poll) trains like the asyncio one."""

    def train(url):
        with SyncClient(url, LAYOUT, initial_weights(LAYOUT), tls=security.client_tls(pki["ca.pem"])) as client:
            w = client.pull()
            for _ in range(3):
                w = client.push_pull(np.ones(LAYOUT.size, np.float32), w.timestamp)
            return w.timestamp, client._client.conn._pollable

    async with tls_server(pki) as ps:
        assert await asyncio.to_thread(train, ps.addresses[0]) == (3, False)


async def test_tls_client_certificates_when_the_server_asks(pki):
    async with tls_server(pki, client_ca="ca.pem") as ps:
        url = ps.addresses[0]
        with pytest.raises(ConnectError, match="requires a client certificate, most likely: give --tls-cert"):
            await train_briefly(url, tls=security.client_tls(pki["ca.pem"]))  # no client certificate
        both = security.client_tls(pki["ca.pem"], pki["host.pem"], pki["host.key"])
        assert await train_briefly(url, tls=both, secret=None) == 3


async def test_the_secret_and_tls_together(pki):
    cfg = ServerConfig(listen=["tcp://127.0.0.1:0"], kernel="numpy", tls_cert=pki["host.pem"], tls_key=pki["host.key"])
    async with ParameterServer(cfg, secret=SECRET) as ps:
        tls = security.client_tls(pki["ca.pem"])
        with pytest.raises(RemoteError, match="requires authentication"):
            await train_briefly(ps.addresses[0], tls=tls)
        assert await train_briefly(ps.addresses[0], tls=tls, secret=SECRET) == 3


async def test_a_learner_with_a_secret_refuses_a_server_that_cannot_prove_it():
    async with run_server(kernel="numpy") as ps:
        with pytest.raises(RemoteError, match="will not talk") as info:
            await train_briefly(ps.addresses[0], secret=SECRET)
        assert info.value.code == "auth_unavailable"
    async with run_server(kernel="numpy", secret="another secret, 32 bytes long..") as ps:
        with pytest.raises(RemoteError, match="the secrets differ") as info:  # the learner proves first
            await train_briefly(ps.addresses[0], secret=SECRET)
        assert info.value.code == "auth_failed" and ps.core.store is None  # nothing reached it

    async def impostor(reader, writer):
        """Takes the learner's proof and claims it is fine, without the secret to prove itself."""
        await read_frame(reader)  # AUTH
        writer.write(raw(MsgType.CHALLENGE, {"nonce": security.new_nonce()}))
        await read_frame(reader)  # PROOF
        writer.write(raw(MsgType.AUTHENTICATED, {"proof": bytes(32)}))
        with contextlib.suppress(Exception):
            await reader.read()
        writer.close()

    fake = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = fake.sockets[0].getsockname()[1]
    with pytest.raises(ConnectError, match="does not know the secret"):
        await train_briefly(f"tcp://127.0.0.1:{port}", secret=SECRET)
    fake.close()
    await fake.wait_closed()


def test_secrets_come_from_a_file_or_the_environment_never_a_short_one(tmp_path, monkeypatch):
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    f.chmod(0o600)
    assert security.load_secret(str(f)) == SECRET.encode()
    monkeypatch.setenv(security.SECRET_ENV, "from the environment, long enough")
    assert security.load_secret(None) == b"from the environment, long enough"
    assert security.load_secret(str(f)) == SECRET.encode()  # the file wins
    monkeypatch.setenv(security.SECRET_ENV, "short")
    with pytest.raises(ConfigError, match="at least 16 are needed"):
        security.load_secret(None)
    with pytest.raises(ConfigError, match="cannot read the secret file"):
        security.load_secret(str(tmp_path / "missing"))


def test_a_server_will_not_serve_other_hosts_without_a_secret(tmp_path):
    for url in ("tcp://0.0.0.0:0", "tcp://[::]:0"):
        proc = run_cli("server", "--listen", url, "--kernel", "numpy", timeout=60, env={"RUDRA_ASYNC_SECRET": ""})
        assert proc.returncode == 2
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert lines[-1].startswith("error: refusing to listen on") and "--insecure" in lines[-1], proc.stderr
        assert "Traceback" not in proc.stderr
    assert transports.is_loopback("tcp://127.0.0.1:7000") and transports.is_loopback("tcp://[::1]:1")
    assert not transports.is_loopback("ucx://127.0.0.1:1") and transports.is_loopback("shm://x")
    port = free_port()
    server = start_cli("server", "--listen", f"tcp://0.0.0.0:{port}", "--insecure", "--kernel", "numpy")
    try:
        from helpers import wait_listening

        wait_listening(port)
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=30)
        assert server.returncode == 0 and "no secret (--insecure)" in err
    finally:
        reap(server)


@pytest.mark.torch
def test_learners_pass_the_secret_from_a_file_or_the_environment(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    port = free_port()
    server = start_server(port, "--secret-file", str(secret), "--max-updates", "6", "--kernel", "numpy")
    try:
        url = f"tcp://127.0.0.1:{port}"
        denied = run_cli("learner", "--connect", url, "--timeout", "5", env={"RUDRA_ASYNC_SECRET": ""})
        assert denied.returncode == 2 and "requires authentication" in denied.stderr
        assert "Traceback" not in denied.stderr
        ok = run_cli("learner", "--connect", url, "--json", env={"RUDRA_ASYNC_SECRET": SECRET})
        assert ok.returncode == 0, ok.stderr
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=30)
        assert server.returncode == 0
        assert '"auth_required": 1' in err
    finally:
        reap(server)


async def test_a_hello_that_is_never_answered_is_a_clear_error():
    done = asyncio.Event()

    async def silent(reader, writer):
        await reader.read()  # accepts, reads, never answers
        writer.close()
        done.set()

    srv = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    with pytest.raises(ConnectError, match=r"sent no WELCOME within 0\.3 s"):
        await Client.connect(f"tcp://127.0.0.1:{port}", LAYOUT, initial_weights(LAYOUT), timeout=0.3)
    await asyncio.wait_for(done.wait(), 5)
    srv.close()
    await srv.wait_closed()


async def test_a_resumed_server_says_so_in_its_welcome(tmp_path):
    path = str(tmp_path / "c.ckpt")
    async with run_server(kernel="numpy", checkpoint=path) as ps:
        await train_briefly(ps.addresses[0])
    assert checkpoint.load(path).clock == 3
    async with run_server(kernel="numpy", resume=path) as ps:
        client = await Client.connect(ps.addresses[0], LAYOUT, timeout=5)
        assert client.resumed_from == 3 and client.clock == 3
        await client.close()
    async with run_server(kernel="numpy") as ps:
        client = await Client.connect(ps.addresses[0], LAYOUT, initial_weights(LAYOUT), timeout=5)
        assert client.resumed_from is None
        await client.close()


@pytest.mark.parametrize("secret, first", [("4f9c2b7e1a8d3c6f0e5b9a2d7c4f1e8b", "auth"), (None, "pull")])
async def test_the_handshake_deadline_holds_from_accept_to_hello_whatever_comes_first(secret, first):
    """A peer that sends one frame of the handshake (an AUTH; without a secret, a request
    refused as not registered) and then nothing is closed once --handshake-timeout has passed
    since it connected, like a silent one: a frame must not switch the deadline off."""
    import os
    import time

    from rudra_async.wire import MsgType, encode_frame

    async with run_server(secret=secret, handshake_timeout=0.5) as ps:
        host, port = ps.addresses[0].removeprefix("tcp://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            start = time.monotonic()
            msg_type, meta = (MsgType.AUTH, {"nonce": os.urandom(32)}) if first == "auth" else (MsgType.PULL, {})
            writer.write(b"".join(bytes(p) for p in encode_frame(msg_type, meta)))
            await writer.drain()
            while await asyncio.wait_for(reader.read(1 << 16), 5):  # the reply, then the end
                pass
            assert time.monotonic() - start < 3
            assert ps.stats()["rejected"].get("handshake_timeout") == 1
        finally:
            writer.close()


async def test_connections_still_in_their_tls_handshake_count_against_the_connection_limits(pki):
    """Peers that open tcp connections to a TLS server and never start the handshake are held
    to --max-unauthenticated like any peer before hello (the oldest are closed at once, not
    after --handshake-timeout), so they cannot pile up; a learner still trains meanwhile."""
    async with tls_server(pki, max_unauthenticated=2, handshake_timeout=60) as ps:
        host, port = ps.addresses[0].removeprefix("tcp://").rsplit(":", 1)
        silent = [await asyncio.open_connection(host, int(port)) for _ in range(5)]
        try:

            async def closed_by_server(reader) -> bool:
                try:
                    return await asyncio.wait_for(reader.read(1), 0.5) == b""
                except (TimeoutError, ConnectionError):
                    return False

            assert [await closed_by_server(reader) for reader, _ in silent] == [True] * 3 + [False] * 2
            assert ps.stats()["rejected"].get("evicted") == 3
            assert await train_briefly(ps.addresses[0], tls=security.client_tls(pki["ca.pem"])) == 3
        finally:
            for _, writer in silent:
                writer.close()


async def test_a_tls_peer_that_never_completes_its_handshake_is_closed_at_the_handshake_deadline(pki):
    """Over TLS too, --handshake-timeout runs from the connection's arrival: a peer that sends
    no ClientHello is closed and counted (handshake_timeout), one beyond --max-connections is
    refused before any handshake (too_many_connections), and nothing of either is left."""
    async with tls_server(pki, handshake_timeout=0.5, max_connections=1) as ps:
        host, port = ps.addresses[0].removeprefix("tcp://").rsplit(":", 1)
        silent = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
        try:
            for reader, _ in silent:
                assert await asyncio.wait_for(reader.read(1), 5) == b""
            rejected = ps.stats()["rejected"]
            assert (rejected.get("handshake_timeout"), rejected.get("too_many_connections")) == (1, 1)
            assert not ps._sessions  # no session outlives its connection
            assert await train_briefly(ps.addresses[0], tls=security.client_tls(pki["ca.pem"])) == 3
        finally:
            for _, writer in silent:
                writer.close()


async def test_closing_a_tls_server_during_handshakes_leaves_no_session_behind(pki):
    """Connections still in their TLS handshake when the server closes end like any other:
    no session outlives them."""
    ps = tls_server(pki)
    async with ps:
        host, port = ps.addresses[0].removeprefix("tcp://").rsplit(":", 1)
        silent = [await asyncio.open_connection(host, int(port)) for _ in range(3)]
        await asyncio.sleep(0.2)
        assert len(ps._sessions) == 3
    assert not ps._sessions and not ps._unregistered
    for _, writer in silent:
        writer.close()


def test_a_transport_declares_whether_only_this_host_reaches_it():
    """``same_host`` (shm, memory, a plugin's Unix socket) makes every address loopback; tcp
    asks its host; a transport that declares nothing is reachable from other hosts."""

    class SameHost(transports.Transport):
        scheme = "samehost"
        same_host = True

        async def connect(self, url, *, limits, timeout):
            raise NotImplementedError

        async def listen(self, url, on_connection, *, limits, on_accept=None):
            raise NotImplementedError

    class Undeclared(SameHost):
        scheme = "undeclared"
        same_host = False

    assert SameHost().reaches_only_this_host("samehost://anything")
    assert not Undeclared().reaches_only_this_host("undeclared://127.0.0.1:1")
    assert Undeclared().fresh_address("::1") == "undeclared://[::1]:0"
    assert transports.transport_for("shm://").fresh_address() == "shm://"
    assert not transports.is_loopback("tcp://10.0.0.1:7000") and transports.is_loopback("memory://x")


def test_the_plain_traffic_warning_names_what_is_missing(pki, caplog):
    """With --tls-cert given, an exposed address whose transport has no TLS is named as such
    (not told to give --tls-cert); without it, the warning says to give it."""
    tls = dict(tls_cert=pki["host.pem"], tls_key=pki["host.key"])
    with caplog.at_level("WARNING", logger="rudra_async"):
        ParameterServer(ServerConfig(listen=["ucx://0.0.0.0:0"], kernel="numpy", **tls), secret=SECRET)
        ParameterServer(ServerConfig(listen=["tcp://0.0.0.0:0"], kernel="numpy", **tls), secret=SECRET)
        ParameterServer(ServerConfig(listen=["tcp://0.0.0.0:0"], kernel="numpy"), secret=SECRET)
    plain = [r.getMessage() for r in caplog.records if "not encrypted" in r.getMessage()]
    assert plain == [
        "traffic on ucx://0.0.0.0:0 is not encrypted (ucx://: its transport has no TLS)",
        "traffic on tcp://0.0.0.0:0 is not encrypted (tcp://: give --tls-cert for TLS)",
    ]
