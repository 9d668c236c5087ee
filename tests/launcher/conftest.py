"""The ``launch`` fixture: start ``ds-recycle launch`` jobs that cannot outlive the test (see launch_harness)."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.launcher.launch_harness import LaunchedJob, launched_jobs


@pytest.fixture
def launch() -> Iterator[Callable[..., LaunchedJob]]:
    with launched_jobs() as start:
        yield start
