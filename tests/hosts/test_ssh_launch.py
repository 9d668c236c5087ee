"""`ds-recycle launch --hostfile` over real ssh into hosts that are network namespaces (tests/nethosts.py)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness import assert_same_model
from tests.hosts.cluster import HostJob
from tests.hosts.conftest import SHORT_STEPS
from tests.nethosts import NetHosts

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(240)
def test_ssh_2x2_over_a_slow_link_trains_the_one_host_model(nethosts: Callable[[int], NetHosts], tmp_path: Path,
                                                            reference_2x2: tuple[Path, Path]) -> None:
    """Node 0 starts node 1 over ssh; node 1's link is slowed (netem delay, or a tbf rate limit where the kernel
    has no netem) well below the timeouts: no failure (at most a switch to the plan for the measured costs), and the
    final model is the one-host run's."""
    config, reference = reference_2x2
    hosts = nethosts(2)
    applied = hosts.slow(1, 50)  # every packet of host 1 50 ms late (netem), or its bandwidth 2 Mbit/s (tbf)
    job = HostJob(hosts, tmp_path, config, SHORT_STEPS, slots=2, worker_hosts=[0, 1])
    job.start_ssh()
    codes = job.finish(200)
    assert codes == {"node0": 0}, job.logs()
    node0 = job.text("node0")
    assert "started node 1 on 10.213.0.2" in node0 and "job succeeded with status 0: 4 rank(s) finished" in node0
    assert "[ds-recycle launch node 1]" in node0  # node 1's launcher ran on host 1, its output came back over ssh
    recs = job.metrics()
    assert [r["iter"] for r in recs] == list(range(SHORT_STEPS)), applied
    assert all(r["live_workers"] == 4 for r in recs), (applied, recs)
    # no failure; the one event allowed is the switch to a plan made for the costs the job measured (the slow link's
    # transfers among them)
    events = [e for r in recs for e in r["events"]]
    assert all(e["kind"] == "plan_switch" and e["measured"] and not e["absent"] for e in events), (applied, events)
    assert_same_model(job.final_path, reference)
    assert len(hosts.pids(1)) == 1, "only host 1's sshd may be left: no launcher, no worker"
