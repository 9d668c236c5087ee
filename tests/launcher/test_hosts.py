"""Hostfile, --include/--exclude and --num_nodes/--num_accelerators parsing (pure, no processes)."""
from __future__ import annotations

from pathlib import Path

import pytest

from ds_recycle.launcher.hosts import (
    HostfileError,
    Layout,
    NodeSlots,
    filter_resources,
    limit_resources,
    parse_hostfile,
    parse_node_specs,
    resolve_layout,
)

HOSTFILE = """\
# two boxes
worker-0 slots=4
worker-1 slots=2   # the small one

worker-2 slots=3
"""
POOL = {"worker-0": 4, "worker-1": 2, "worker-2": 3}


def test_hostfile_keeps_order_and_ignores_comments() -> None:
    pool = parse_hostfile(HOSTFILE)
    assert pool == POOL and list(pool) == ["worker-0", "worker-1", "worker-2"]


@pytest.mark.parametrize("text, message", [
    ("worker-0 slots=4\nworker-0 slots=2\n", "listed twice"),
    ("worker-0 4\n", "is not 'HOST slots=N'"),
    ("worker-0 slots=0\n", "slots=0"),
    ("# nothing\n\n", "no 'HOST slots=N' line"),
])
def test_bad_hostfiles_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(HostfileError, match=message):
        parse_hostfile(text)


def test_node_specs() -> None:
    assert parse_node_specs("worker-0@worker-1:2,0,2", "--include") == {"worker-0": (), "worker-1": (0, 2)}
    with pytest.raises(HostfileError, match="not integers"):
        parse_node_specs("worker-1:a", "--include")
    with pytest.raises(HostfileError, match="empty host name"):
        parse_node_specs("worker-0@:1", "--include")


def test_include_keeps_pool_order_and_whole_hosts() -> None:
    active = filter_resources(POOL, include="worker-2:1@worker-0")
    assert active == {"worker-0": (0, 1, 2, 3), "worker-2": (1,)} and list(active) == ["worker-0", "worker-2"]


def test_exclude_slots_and_whole_hosts() -> None:
    assert filter_resources(POOL, exclude="worker-0:0,3@worker-1") == {"worker-0": (1, 2), "worker-2": (0, 1, 2)}


@pytest.mark.parametrize("include, exclude, message", [
    ("worker-9", "", "not in the pool"),
    ("worker-1:5", "", r"not \[5\]"),
    ("worker-0", "worker-1", "mutually exclusive"),
])
def test_bad_filters(include: str, exclude: str, message: str) -> None:
    with pytest.raises(HostfileError, match=message):
        filter_resources(POOL, include, exclude)


def test_num_nodes_and_num_accelerators() -> None:
    active = filter_resources(POOL)
    assert limit_resources(active, 2, None) == {"worker-0": (0, 1, 2, 3), "worker-1": (0, 1)}
    assert limit_resources(active, None, 1) == {h: (0,) for h in POOL}
    with pytest.raises(HostfileError, match="--num_nodes 4"):
        limit_resources(active, 4, None)


def test_layout_ranks_offsets_and_round_trip(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text(HOSTFILE)
    layout = resolve_layout(str(hostfile), "", "worker-0:1", None, None, local_slots=1)
    assert layout.nodes == (NodeSlots("worker-0", (0, 2, 3)), NodeSlots("worker-1", (0, 1)),
                            NodeSlots("worker-2", (0, 1, 2)))
    assert layout.world_size == 8 and [layout.offset(k) for k in range(3)] == [0, 3, 5]
    assert Layout.decode(layout.encode()) == layout
    with pytest.raises(HostfileError, match="--node_rank 3"):
        layout.offset(3)


def test_single_host_without_hostfile() -> None:
    assert resolve_layout(None, "", "", None, 4, local_slots=1).nodes == (NodeSlots("localhost", (0, 1, 2, 3)),)
    assert resolve_layout(None, "", "", None, None, local_slots=2).world_size == 2
    assert resolve_layout(None, "localhost:1", "", None, None, local_slots=2).nodes == (NodeSlots("localhost", (1,)),)
    with pytest.raises(HostfileError, match="needs a --hostfile"):
        resolve_layout(None, "", "", 2, None, local_slots=1)
    with pytest.raises(HostfileError, match="cannot be combined"):
        resolve_layout(None, "localhost:0", "", None, 2, local_slots=1)
    with pytest.raises(HostfileError, match="does not exist"):
        resolve_layout("/nonexistent/hosts", "", "", None, None, local_slots=1)
