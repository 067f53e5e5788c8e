"""Every test here runs the project end to end (real commands, real processes): marked ``e2e``
(``-m "not e2e"`` leaves them out)."""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.e2e)
