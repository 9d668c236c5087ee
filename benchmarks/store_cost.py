"""What coordination on etcd costs against the launcher's own TCPStore: latency per store operation, and the
failure-free time per iteration of a real job (alternated runs, one after the other).

    .venv/bin/python benchmarks/store_cost.py [--ops 300] [--runs 3] [--steps 40] [--out FILE]

The etcd cluster is three real members (Debian's etcd 3.4, ``tests/etcd_cluster.py``) on this host's loopback,
the TCPStore a server in this process; each client is a separate connection (a TCPStore ``set`` does not wait
for an answer, so its figure is the client's send alone). The job is the tests' tiny 2 x 2 GPT
(``tests.harness.tiny_config``) under ``ds-recycle launch``, once with its default store and once with
``--store etcd://...``, alternated ``--runs`` times; the per-iteration time is the median ``iter_time_s`` of the
metrics after the first 5 iterations. Real compute on CPU (gloo), not emulated.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch.distributed as dist  # noqa: E402

from ds_recycle.runtime.etcd_store import EtcdStore  # noqa: E402
from tests.etcd_cluster import EtcdCluster  # noqa: E402
from tests.harness import launch, tiny_config  # noqa: E402


def _latencies(store: Any, ops: int) -> dict[str, float]:
    """Median microseconds per operation."""
    def timed(fn: Callable[[int], Any]) -> float:
        samples = []
        for i in range(ops):
            start = time.perf_counter()
            fn(i)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e6

    out = {"set": timed(lambda i: store.set(f"k{i}", "v"))}
    out["get (present)"] = timed(lambda i: store.get(f"k{i}"))
    out["add"] = timed(lambda i: store.add("counter", 1))
    out["add 0 (read a counter)"] = timed(lambda i: store.add("counter", 0))
    out["check"] = timed(lambda i: store.check([f"k{i}"]))
    out["compare_set"] = timed(lambda i: store.compare_set(f"c{i}", "", "x"))
    out["queue_push + queue_pop"] = timed(lambda i: (store.queue_push("q", "x"), store.queue_pop("q")))
    return out


def _iteration_s(tmp: Path, name: str, steps: int, launcher_args: list[str]) -> float:
    config = tiny_config(tmp, f"c-{name}", 2, 2)
    metrics = tmp / f"{name}.jsonl"
    job = launch(4, ["--deepspeed_config", str(config), "--steps", str(steps), "--metrics", str(metrics)],
                 launcher_args=launcher_args, timeout=600)
    if job.returncode != 0:
        raise RuntimeError(f"{name}: the job failed\n{job.output[-3000:]}")
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return statistics.median(r["iter_time_s"] for r in recs if r["iter"] >= 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"store cost, {time.strftime('%Y-%m-%d')}, {platform.node()}, {platform.processor() or platform.machine()}, "
        f"real compute on CPU; command: .venv/bin/python benchmarks/store_cost.py --ops {args.ops} "
        f"--runs {args.runs} --steps {args.steps}")
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        cluster = EtcdCluster(tmp, 3)
        try:
            tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
            client = dist.TCPStore("127.0.0.1", tcp.port, is_master=False, timeout=timedelta(seconds=30))
            etcd = EtcdStore(cluster.endpoints + "/bench", timeout=timedelta(seconds=30))
            t_lat, e_lat = _latencies(client, args.ops), _latencies(etcd, args.ops)
            say(f"\nlatency per operation, median of {args.ops} (microseconds): TCPStore | etcd (3 members) | ratio")
            for op in t_lat:
                say(f"  {op:24s} {t_lat[op]:8.0f} | {e_lat[op]:8.0f} | {e_lat[op] / t_lat[op]:6.1f}x")
            say(f"\nfailure-free 2 x 2 job, {args.steps} iterations, median iteration time after the 5th "
                f"(alternated runs):")
            tcp_s, etcd_s = [], []
            for k in range(args.runs):
                tcp_s.append(_iteration_s(tmp, f"tcp{k}", args.steps, []))
                etcd_s.append(_iteration_s(tmp, f"etcd{k}", args.steps,
                                           ["--store", cluster.endpoints + f"/job{k}"]))
                say(f"  run {k}: TCPStore {tcp_s[-1] * 1e3:6.1f} ms, etcd {etcd_s[-1] * 1e3:6.1f} ms, "
                    f"ratio {etcd_s[-1] / tcp_s[-1]:.3f}")
            ratio = statistics.median(e / t for e, t in zip(etcd_s, tcp_s))
            say(f"  median ratio etcd / TCPStore: {ratio:.3f}")
        finally:
            cluster.close()
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
