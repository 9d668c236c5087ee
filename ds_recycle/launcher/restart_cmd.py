"""``ds-recycle restart``: ask a running ``ds-recycle launch`` job to start lost ranks again, now.

    ds-recycle restart --master_addr 10.0.0.1 --master_port 29500 3
    ds-recycle restart --master_port 29500 --timeout 10 2 5

It connects to the job's store at ``--master_addr:--master_port`` (the address given to ``ds-recycle launch``:
node 0's launcher, or a ``ds-recycle store`` service), writes one request per rank
(``ds_recycle/restart_request/<rank>``, see :mod:`ds_recycle.runtime.job_store`), and waits up to ``--timeout``
seconds for the answers of the launchers that run those ranks.
A rank is restarted iff its process is gone because it was lost, no timed restart of it is due, the job is not
stopping, and ``--max_restarts`` allows it (:mod:`.restart_requests`). One line per rank is printed: on stdout
``rank R: restarted as pid P (restart N of at most M)``, on stderr ``rank R: refused (REASON): ...``.

Exit status: 0 when every rank was restarted; 1 when some rank was refused or not answered in time (or the job
is being stopped); 2 for bad input (a negative, repeated or unknown rank, no job's store at that address).
"""
from __future__ import annotations

import argparse
import socket
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ds_recycle.launcher.restart_requests import RestartResult, new_request_id
from ds_recycle.runtime import job_store as keys

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["add_arguments", "run", "request_restarts"]

_POLL_S = 0.05


def _rank(text: str) -> int:
    try:
        rank = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"RANK {text!r} is not an integer; give global rank numbers, e.g. 3") from None
    if rank < 0:
        raise argparse.ArgumentTypeError(f"RANK {rank} is negative; give global rank numbers 0..WORLD_SIZE-1")
    return rank


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} seconds: give a positive number")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=None, metavar="etcd://HOST:PORT,...[/NAMESPACE]",
                        help="the job's etcd store, as given to `ds-recycle launch --store` (instead of "
                             "--master_addr/--master_port)")
    parser.add_argument("--master_addr", default="127.0.0.1",
                        help="address of the job's store, as given to `ds-recycle launch` (default 127.0.0.1)")
    parser.add_argument("--master_port", type=int, default=29500,
                        help="port of the job's store: the launcher logs it as 'store at ADDR:PORT' (default 29500)")
    parser.add_argument("--timeout", type=_seconds, default=30.0,
                        help="seconds to wait for the launchers' answers (default 30)")
    parser.add_argument("--connect_timeout", type=_seconds, default=10.0,
                        help="seconds to wait for the store connection (default 10)")
    parser.add_argument("ranks", metavar="RANK", type=_rank, nargs="+", help="global rank(s) to restart")


class _BadInput(Exception):
    """A request that cannot be sent: the message names the argument, the value and the fix."""


def _connect(addr: str, port: int, timeout_s: float) -> Store:
    """The job's store as a client; a plain socket probe first, so that 'nothing there' fails fast and quietly."""
    try:
        socket.create_connection((addr, port), timeout=timeout_s).close()
    except OSError as err:
        raise _BadInput(f"nothing answers at --master_addr {addr} --master_port {port} ({err}); give the address "
                        f"and port of a running `ds-recycle launch` job (its log says 'store at ADDR:PORT')") from err
    try:
        return keys.connect_store(addr, port, timeout_s)
    except OSError as err:
        raise _BadInput(str(err)) from err


def _check_ranks(store: Store, ranks: Sequence[int], where: str) -> None:
    world = keys.read_int(store, keys.WORLD_SIZE_KEY)
    if world is None:
        raise _BadInput(f"the store at {where} holds no `ds-recycle launch` job (no {keys.WORLD_SIZE_KEY} key); "
                        f"give the --master_port that the job's launcher logged as 'store at ADDR:PORT'")
    unknown = [r for r in ranks if r >= world]
    if unknown:
        raise _BadInput(f"RANK {unknown}: the job at {where} has ranks 0..{world - 1}")
    if len(set(ranks)) != len(ranks):
        raise _BadInput(f"RANK {list(ranks)}: a rank is given twice; give each rank once")


def _send(store: Store, rank: int, request_id: str) -> str | None:
    """Write the request for ``rank``; the id of an earlier pending request that blocks it, if any."""
    held = store.compare_set(keys.restart_request_key(rank), "", request_id).decode()
    return None if held == request_id else held


def _answer(store: Store, rank: int, request_id: str) -> RestartResult | None:
    key = keys.restart_result_key(rank)
    if not store.check([key]):
        return None
    result = RestartResult.decode(store.get(key).decode())
    return result if result.request_id == request_id else None


def _withdraw(store: Store, rank: int, request_id: str) -> None:
    """Delete our unanswered request, so that a later request is not blocked by it."""
    key = keys.restart_request_key(rank)
    if store.check([key]) and store.get(key).decode() == request_id:
        store.delete_key(key)


def request_restarts(store: Store, ranks: Sequence[int], timeout_s: float) -> dict[int, RestartResult | str]:
    """Ask for the restart of ``ranks``; per rank, the launcher's answer or why there is none (text)."""
    request_id = new_request_id()
    outcome: dict[int, RestartResult | str] = {}
    for rank in ranks:
        blocker = _send(store, rank, request_id)
        if blocker is not None:
            outcome[rank] = f"another restart request for rank {rank} ({blocker}) is pending; wait for its answer"
    store.add(keys.RESTART_REQUESTS_KEY, 1)
    waiting = [r for r in ranks if r not in outcome]
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        for rank in list(waiting):
            result = _answer(store, rank, request_id)
            if result is not None:
                outcome[rank] = result
                waiting.remove(rank)
    for rank in waiting:
        _withdraw(store, rank, request_id)
        outcome[rank] = (f"no answer for rank {rank} within {timeout_s:g} s: the launcher that runs it did not "
                         f"take the request (has its node's launcher ended?); retry with a longer --timeout")
    return outcome


def _print(outcome: dict[int, RestartResult | str]) -> bool:
    """Print one line per rank; True iff every rank was restarted."""
    for rank, result in sorted(outcome.items()):
        if isinstance(result, str):
            print(f"ds-recycle restart: rank {rank}: not restarted: {result}", file=sys.stderr)
        elif result.refusal is not None:
            print(f"ds-recycle restart: rank {rank}: refused ({result.refusal.value}): {result.message}",
                  file=sys.stderr)
        else:
            print(f"rank {rank}: {result.message}")
    return all(isinstance(r, RestartResult) and r.restarted for r in outcome.values())


def _connect_etcd(spec: str, timeout_s: float) -> Store:
    from ds_recycle.runtime.etcd_store import normal_spec

    try:
        return keys.open_store(normal_spec(spec), timeout_s)
    except ValueError as err:
        raise _BadInput(f"--store: {err}") from err


def run(args: argparse.Namespace) -> int:
    where = args.store or f"{args.master_addr}:{args.master_port}"
    try:
        store = (_connect_etcd(args.store, args.connect_timeout) if args.store is not None
                 else _connect(args.master_addr, args.master_port, args.connect_timeout))
        _check_ranks(store, args.ranks, where)
        if store.check([keys.STOP_KEY]):
            print(f"ds-recycle restart: the job at {where} is being stopped "
                  f"({store.get(keys.STOP_KEY).decode()}); no rank is restarted", file=sys.stderr)
            return 1
        outcome = request_restarts(store, args.ranks, args.timeout)
    except _BadInput as err:
        print(f"ds-recycle restart: error: {err}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError, ValueError) as err:  # the store went away mid-way, or a foreign result key
        print(f"ds-recycle restart: error: the job's store at {where} failed: {err}", file=sys.stderr)
        return 1
    return 0 if _print(outcome) else 1
