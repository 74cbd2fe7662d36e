"""Fixtures shared by the multi-rank test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import RankPool


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    """Two gloo ranks for the module's scenarios, one at a time (restarted after a failed one)."""
    ranks = RankPool(2)
    yield ranks
    ranks.close()
