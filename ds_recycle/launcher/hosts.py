"""Which hosts and slots a job runs on: hostfile, ``--include``/``--exclude``, ``--num_nodes``/``--num_accelerators``.

The syntax is the `deepspeed` launcher's, so existing hostfiles and filters keep working:

* hostfile: one ``HOST slots=N`` per line; ``#`` starts a comment; blank lines are ignored::

      worker-0 slots=4
      worker-1 slots=4

* ``--include`` / ``--exclude``: ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC = HOST[:SLOT[,SLOT ...]]``.
  A host without slots means all of its slots. ``--include "worker-0@worker-1:0,2"`` keeps every slot of
  worker-0 and slots 0 and 2 of worker-1; ``--exclude "worker-1:0"`` drops slot 0 of worker-1 only.

Without a hostfile the pool is ``localhost`` with ``--num_accelerators`` slots (default: the visible CUDA
devices, or 1 on a machine without one). Ranks are numbered host by host in hostfile order, slot by slot.
"""
from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "LOCAL_HOST",
    "HostfileError",
    "NodeSlots",
    "Layout",
    "parse_hostfile",
    "read_hostfile",
    "parse_node_specs",
    "filter_resources",
    "limit_resources",
    "resolve_layout",
]

#: the host name of the single-host pool built when no hostfile is given
LOCAL_HOST = "localhost"

_HOSTFILE_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)\s*$")


class HostfileError(ValueError):
    """A hostfile, ``--include``/``--exclude`` string or node count that cannot describe a job."""


@dataclass(frozen=True)
class NodeSlots:
    """One host of the job and the accelerator slots (local device indices) its workers use, in order."""

    host: str
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.slots:
            raise HostfileError(f"host {self.host!r} has no slots left; drop it from --include or the hostfile")


@dataclass(frozen=True)
class Layout:
    """Every node of a job in rank order: node k runs global ranks ``offset(k) .. offset(k)+len(slots)-1``."""

    nodes: tuple[NodeSlots, ...]

    @property
    def world_size(self) -> int:
        return sum(len(node.slots) for node in self.nodes)

    def offset(self, node_rank: int) -> int:
        """The global rank of node ``node_rank``'s first worker."""
        if not 0 <= node_rank < len(self.nodes):
            raise HostfileError(f"--node_rank {node_rank} is outside the job's {len(self.nodes)} node(s)")
        return sum(len(node.slots) for node in self.nodes[:node_rank])

    def encode(self) -> str:
        """A shell-safe string that :meth:`decode` turns back into this layout (passed to remote launchers)."""
        doc = [[node.host, list(node.slots)] for node in self.nodes]
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode()

    @staticmethod
    def decode(text: str) -> Layout:
        try:
            doc = json.loads(base64.urlsafe_b64decode(text.encode()))
            return Layout(tuple(NodeSlots(str(host), tuple(int(s) for s in slots)) for host, slots in doc))
        except (ValueError, TypeError) as err:
            raise HostfileError(f"--world_info {text!r} is not a layout written by `ds-recycle launch`: {err}") from err


def parse_hostfile(text: str, source: str = "<hostfile>") -> dict[str, int]:
    """Parse hostfile text into ``{host: slot count}`` in file order."""
    pool: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOSTFILE_LINE.match(line)
        if match is None:
            raise HostfileError(f"{source}:{number}: {raw.strip()!r} is not 'HOST slots=N' (e.g. 'worker-0 slots=4')")
        host, slots = match["host"], int(match["slots"])
        if host in pool:
            raise HostfileError(f"{source}:{number}: host {host!r} is listed twice; keep one line per host")
        if slots < 1:
            raise HostfileError(f"{source}:{number}: host {host!r} has slots={slots}; it must be at least 1")
        pool[host] = slots
    if not pool:
        raise HostfileError(f"{source}: no 'HOST slots=N' line; add one per host or drop --hostfile")
    return pool


def read_hostfile(path: str | Path) -> dict[str, int]:
    """Read and parse a hostfile; a missing file is an error naming the path."""
    file = Path(path)
    if not file.is_file():
        raise HostfileError(f"--hostfile {str(path)!r} does not exist; give an existing file or drop --hostfile")
    return parse_hostfile(file.read_text(encoding="utf-8"), source=str(path))


def parse_node_specs(text: str, option: str) -> dict[str, tuple[int, ...]]:
    """Parse ``HOST[:SLOT[,SLOT...]][@...]`` into ``{host: slots}``; empty slots mean "the whole host"."""
    specs: dict[str, list[int]] = {}
    for spec in text.split("@"):
        host, sep, slot_text = spec.strip().partition(":")
        if not host:
            raise HostfileError(f"{option} {text!r}: empty host name in {spec!r}; use HOST[:SLOT,...]@HOST...")
        slots = specs.setdefault(host, [])
        if sep:
            try:
                slots.extend(int(s) for s in slot_text.split(","))
            except ValueError:
                raise HostfileError(f"{option} {text!r}: slots {slot_text!r} of {host!r} are not integers like 0,2") from None
    return {host: tuple(sorted(set(slots))) for host, slots in specs.items()}


def filter_resources(pool: dict[str, int], include: str = "", exclude: str = "") -> dict[str, tuple[int, ...]]:
    """Apply ``--include`` or ``--exclude`` to a ``{host: slot count}`` pool, keeping the pool's host order."""
    if include and exclude:
        raise HostfileError("--include and --exclude are mutually exclusive; give one of them")
    active = {host: tuple(range(count)) for host, count in pool.items()}
    if not include and not exclude:
        return active
    option, text = ("--include", include) if include else ("--exclude", exclude)
    specs = parse_node_specs(text, option)
    for host, slots in specs.items():
        if host not in active:
            raise HostfileError(f"{option}: host {host!r} is not in the pool {sorted(active)}")
        missing = sorted(set(slots) - set(active[host]))
        if missing:
            raise HostfileError(f"{option}: host {host!r} has slots {list(active[host])}, not {missing}")
    if include:
        chosen = {host: slots or active[host] for host, slots in specs.items()}
    else:
        chosen = {host: _without(slots, specs[host]) if host in specs else slots for host, slots in active.items()}
    return {host: chosen[host] for host in active if chosen.get(host)}


def _without(slots: tuple[int, ...], excluded: tuple[int, ...]) -> tuple[int, ...]:
    """``slots`` minus ``excluded``; an empty ``excluded`` (a bare host name) removes every slot."""
    return tuple(s for s in slots if excluded and s not in excluded)


def limit_resources(active: dict[str, tuple[int, ...]], num_nodes: int | None,
                    num_accelerators: int | None) -> dict[str, tuple[int, ...]]:
    """Keep the first ``num_nodes`` hosts, and slots ``0..num_accelerators-1`` on each (as `deepspeed` does)."""
    if num_nodes is not None:
        if not 1 <= num_nodes <= len(active):
            raise HostfileError(f"--num_nodes {num_nodes}: the pool has {len(active)} host(s); give 1..{len(active)}")
        active = dict(list(active.items())[:num_nodes])
    if num_accelerators is not None:
        if num_accelerators < 1:
            raise HostfileError(f"--num_accelerators {num_accelerators}: must be at least 1")
        active = {host: tuple(range(num_accelerators)) for host in active}
    return active


def resolve_layout(hostfile: str | None, include: str, exclude: str, num_nodes: int | None,
                   num_accelerators: int | None, local_slots: int) -> Layout:
    """The job's layout from the launcher options; ``local_slots`` sizes the pool when there is no hostfile."""
    if (include or exclude) and (num_nodes is not None or num_accelerators is not None):
        raise HostfileError("--include/--exclude cannot be combined with --num_nodes/--num_accelerators; pick one way")
    if hostfile is None:
        if num_nodes is not None and num_nodes > 1:
            raise HostfileError(f"--num_nodes {num_nodes} needs a --hostfile listing the hosts")
        pool = {LOCAL_HOST: num_accelerators if num_accelerators is not None else local_slots}
    else:
        pool = read_hostfile(hostfile)
    active = limit_resources(filter_resources(pool, include, exclude), num_nodes, num_accelerators)
    if not active:
        raise HostfileError(f"--include/--exclude left no host; pool was {pool}")
    return Layout(tuple(NodeSlots(host, slots) for host, slots in active.items()))
