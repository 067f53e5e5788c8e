try:
    import pytest_asyncio  # noqa: F401
except ImportError:  # e.g. the GPU check on a machine that has only pytest (benchmarks/gpu_check.sh)
    pass
else:

    def pytest_asyncio_loop_factories(config, item):
        """Async tests run on uvloop, the loop the server uses in production."""
        import uvloop

        return {"uvloop": uvloop.new_event_loop}
