import importlib.util
import threading

import pytest

from rudra_async.logs import DEFAULT_LIMIT
from rudra_async.server import store

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
