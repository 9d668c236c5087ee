"""Fixtures of the several-hosts tests: hosts as network namespaces (skipped, saying why, without root), and
the one-host runs whose final models the several-hosts runs must equal."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.harness import launch, tiny_config
from tests.nethosts import NetHosts, namespaces_refused

#: iterations of the 3-pipeline jobs whose lost or cut-off host comes back while the others train (its ranks
#: rejoined 10-17 iterations in on a 2-core machine; a faster machine trains more iterations meanwhile; a host that
#: boots again with an etcd member is waited for with the members paused, tests/hosts/test_etcd_hosts.py)
REJOIN_STEPS = 60
SHORT_STEPS = 12


@pytest.fixture
def nethosts(tmp_path: Path) -> Iterator[Callable[[int], NetHosts]]:
    """``nethosts(n)``: ``n`` fresh hosts, torn down after the test whatever happened."""
    reason = namespaces_refused()
    if reason is not None:
        pytest.skip(f"several-hosts tests need network namespaces and sshd: {reason}")
    made: list[NetHosts] = []

    def make(n: int) -> NetHosts:
        hosts = NetHosts(n, tmp_path)
        made.append(hosts)
        return hosts.__enter__()

    try:
        yield make
    finally:
        for hosts in made:
            hosts.close()


def host_config(folder: Path, pipelines: int) -> Path:
    """The tests' tiny 2-stage GPT; with 3 pipelines trained by SGD with momentum instead of Adam.

    With 3 pipelines a re-routed or rejoined run equals the failure-free one only up to summation order (about
    1e-7 per step). Adam divides each gradient by its own running magnitude, so on parameters whose gradient
    is zero up to rounding (the attention's key bias: softmax ignores a constant added to every key) it turns
    that rounding into full-size steps, and over 260 iterations the key biases drifted apart by 2.6e-3
    (measured). SGD keeps rounding at rounding size, so the comparison stays at atol 1e-5.
    """
    config = tiny_config(folder, f"hosts{pipelines}", 2, pipelines)
    if pipelines == 3:
        data = json.loads(config.read_text())
        data["optimizer"] = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
        config.write_text(json.dumps(data))
    return config


def _reference(folder: Path, pipelines: int, steps: int) -> tuple[Path, Path]:
    config = host_config(folder, pipelines)
    final = folder / f"ref{pipelines}.pt"
    job = launch(2 * pipelines, ["--deepspeed_config", str(config), "--steps", str(steps), "--save-final", str(final)])
    assert job.returncode == 0, job.output[-3000:]
    return config, final


@pytest.fixture(scope="session")
def reference_2x2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(config, final model) of a 2-stage x 2-pipeline job of SHORT_STEPS on one host."""
    if namespaces_refused() is not None:
        pytest.skip("several-hosts tests need network namespaces and sshd")
    return _reference(tmp_path_factory.mktemp("ref2x2"), 2, SHORT_STEPS)


@pytest.fixture(scope="session")
def reference_2x3_short(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(config, final model) of a 2-stage x 3-pipeline job of SHORT_STEPS on one host (for a loss before the
    first iteration, which needs no long run)."""
    if namespaces_refused() is not None:
        pytest.skip("several-hosts tests need network namespaces and sshd")
    return _reference(tmp_path_factory.mktemp("ref2x3short"), 3, SHORT_STEPS)


@pytest.fixture(scope="session")
def reference_2x3_rejoin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(config, final model) of a 2-stage x 3-pipeline job of REJOIN_STEPS on one host."""
    if namespaces_refused() is not None:
        pytest.skip("several-hosts tests need network namespaces and sshd")
    return _reference(tmp_path_factory.mktemp("ref2x3rejoin"), 3, REJOIN_STEPS)

