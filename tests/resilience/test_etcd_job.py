"""A job whose coordination lives on a real 3-member etcd cluster (``ds-recycle launch --store etcd://...``): the
etcd leader SIGKILLed mid-training and a worker killed after it, the job goes on and ends at the failure-free model
bit for bit. Skipped, saying why, where etcd is not installed (``launch/setup_hosts.sh`` installs it)."""
from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from ds_recycle.events import FailureEvent, events_of  # noqa: E402
from tests.etcd_cluster import ETCD, EtcdCluster  # noqa: E402
from tests.harness import assert_same_model, launch, tiny_config  # noqa: E402

STEPS = 7
"""As ``test_survival.py``: the failure-free reference is shared."""


def _iteration(metrics: Path) -> int:
    if not metrics.exists():
        return -1
    its = [json.loads(line).get("iter", -1) for line in metrics.read_text().splitlines() if line.strip().endswith("}")]
    return max(its, default=-1)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.skipif(ETCD is None, reason="etcd is not installed: `sudo bash launch/setup_hosts.sh`")
def test_etcd_leader_and_a_worker_lost_same_model(tmp_path: Path, reference: Callable[[int, int, int], Path]) -> None:
    cluster = EtcdCluster(tmp_path, 3)
    try:
        config = tiny_config(tmp_path, "c", 2, 2, failure_timeout_s=60.0)
        out, metrics = tmp_path / "final.pt", tmp_path / "m.jsonl"
        leader_killed: list[int] = []

        def kill_leader() -> None:
            deadline = time.monotonic() + 200
            while _iteration(metrics) < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            leader = cluster.leader()
            cluster.kill(leader)
            leader_killed.append(leader)
        killer = threading.Thread(target=kill_leader, daemon=True)
        killer.start()
        job = launch(4, ["--deepspeed_config", str(config), "--steps", str(STEPS), "--save-final", str(out),
                         "--metrics", str(metrics), "--kill", "1:0@4:forward"],
                     launcher_args=["--store", cluster.endpoints + "/leader-test"], timeout=240)
        killer.join(5)
        assert job.returncode == 0, job.output[-5000:]
        assert leader_killed, "the etcd leader was never killed (the job ended first?)"
        assert [e.lost_workers for e in events_of(job.metrics(metrics), FailureEvent)] == [((1, 0),)]
        assert_same_model(out, reference(2, 2, STEPS))
    finally:
        cluster.close()
