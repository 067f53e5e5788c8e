import importlib.util

import pytest

from rudra_async.logs import DEFAULT_LIMIT

HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture(autouse=True)
def _fresh_log_rate_limit():
    """Each test starts with the full budget of the server loggers' rate limit, so what one
    test logged does not suppress what the next one checks."""
    DEFAULT_LIMIT.reset()


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
