"""Fixtures shared by the multi-rank test modules, and the order of the suite: tests marked `slow`
(pyproject.toml registers the mark: what `make test-quick` leaves out) run after all the others, so
that the quick ones report first; `--run-first PART` puts the tests whose node id contains PART
before all others (scripts/gpu/run.sh: the regressions of the last GPU run, reported first even if
the step is cut at its budget)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.harness import RankPool


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-first",
        action="append",
        default=[],
        metavar="PART",
        help="run the tests whose node id contains PART before the others (repeatable)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = config.getoption("run_first")
    # stable: the order is kept within each group
    items.sort(
        key=lambda item: (
            not any(part in item.nodeid for part in first),
            item.get_closest_marker("slow") is not None,
        )
    )


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    """Two gloo ranks for the module's scenarios, one at a time (restarted after a failed one)."""
    ranks = RankPool(2)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def pools() -> Iterator[Callable[[int], RankPool]]:
    """`pools(world_size)`: gloo ranks of that world size for the module's scenarios (a module that
    runs its cases at 2, 3 and 4 ranks). Asking for one size stops the ranks of the others, so the
    module holds one set at a time; a pool asked for again restarts its ranks (under a second)."""
    made: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        for size, other in made.items():
            if size != world_size:
                other.close()
        return made.setdefault(world_size, RankPool(world_size))

    yield get
    for ranks in made.values():
        ranks.close()


@pytest.fixture(scope="module")
def one_rank() -> Iterator[RankPool]:
    """One gloo rank (a world of one: torchrec's collectives are no-ops there)."""
    ranks = RankPool(1)
    yield ranks
    ranks.close()
