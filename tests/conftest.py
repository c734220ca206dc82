"""Shared test setup: GPU tests skip cleanly without CUDA; tests run with one intra-op thread."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    # 2-core CI: intra-op threads fighting the test process's own threads only add noise.
    torch.set_num_threads(1)
