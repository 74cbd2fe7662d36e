"""Fixtures shared by the multi-rank test modules, and the order of the suite: tests marked `slow`
(pyproject.toml registers the mark: what `make test-quick` leaves out) run after all the others, so
that the quick ones report first."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import RankPool


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)  # stable: order kept


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    """Two gloo ranks for the module's scenarios, one at a time (restarted after a failed one)."""
    ranks = RankPool(2)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def one_rank() -> Iterator[RankPool]:
    """One gloo rank (a world of one: torchrec's collectives are no-ops there)."""
    ranks = RankPool(1)
    yield ranks
    ranks.close()
