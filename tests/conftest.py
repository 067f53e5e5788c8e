import importlib.util
import threading

import pytest

from rudra_async.logs import DEFAULT_LIMIT
from rudra_async.server import store
from rudra_async.transports import offload

HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture(autouse=True)
def _fresh_log_rate_limit():
    """Each test starts with the full budget of the server loggers' rate limit, so what one
    test logged does not suppress what the next one checks."""
    DEFAULT_LIMIT.reset()


@pytest.fixture(params=["on the loop", "off the loop"])
def update_thread(request, monkeypatch):
    """Run a server test both ways: updates computed on the event loop (what small models
    get) and on the background update thread (what large ones get; forced here for every
    size). ``update_thread.used()`` says whether that thread exists now."""
    off = request.param == "off the loop"
    if off:
        monkeypatch.setattr(store, "BACKGROUND_MIN_VALUES", 1)

    class UpdateThread:
        expected = off

        @staticmethod
        def used() -> bool:
            return any(t.name.startswith("rudra-update") for t in threading.enumerate())

    return UpdateThread


class SendThreads:
    """``send_threads(n)``: stream connections hand every frame whose body is at least ``n``
    bytes (0: none) to a sender thread; ``calls`` lists the threads that wrote a frame,
    ``writing`` counts those writing now."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.writing = 0  # frames being written by threads now

    def __call__(self, nbytes: int) -> None:
        offload.set_min_bytes(nbytes)

    def spy(self, write_all):
        def spying(*args):
            self.calls.append(threading.current_thread().name)
            self.writing += 1
            try:
                return write_all(*args)
            finally:
                self.writing -= 1

        return spying


@pytest.fixture
def send_threads(monkeypatch):
    """A :class:`SendThreads` for one test; the threshold comes back after it."""
    threads = SendThreads()
    monkeypatch.setattr(offload, "write_all", threads.spy(offload.write_all))
    before = offload.min_bytes()
    yield threads
    offload.set_min_bytes(before)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``torch`` need PyTorch; a server-only install (no learner extra, e.g. the
    other Python versions in .ci/run) leaves them out instead of failing on the import."""
    if HAS_TORCH:
        return
    kept = [item for item in items if item.get_closest_marker("torch") is None]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept


@pytest.hookimpl(optionalhook=True)  # pytest-asyncio's hook; absent (or disabled) on the GPU check
def pytest_asyncio_loop_factories(config, item):
    """Async tests run on uvloop, the loop the server uses in production."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}
