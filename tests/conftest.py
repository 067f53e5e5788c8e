def pytest_asyncio_loop_factories(config, item):
    """Async tests run on uvloop, the loop the server uses in production."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}
