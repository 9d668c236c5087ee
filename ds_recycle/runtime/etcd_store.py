"""A ``torch.distributed.Store`` on a replicated etcd cluster (v3 API), so that no single host holds the job's
coordination.

:class:`EtcdStore` speaks etcd's v3 JSON gateway (``/v3/kv/...``, served by every etcd >= 3.4 member) through
``etcd3gw``'s HTTP client, and gives the operations the job uses the semantics of torch's ``TCPStore``: ``set``,
``get`` (waits for the key, up to the store's timeout), ``add``, ``compare_set`` (an absent key matches ``""``),
``check``, ``wait``, ``delete_key``, ``num_keys``, and the queues (``queue_push``, ``queue_pop``, ``queue_len``).
torch's own C++ code (gloo's rendezvous through a ``PrefixStore``) calls it through the Python ``Store``
trampoline like any store.

- Every write that depends on a read is one etcd transaction: ``add`` compares the key's ``mod_revision``,
  ``compare_set`` its value (or its absence), a queue pop the item's ``mod_revision``, so concurrent clients
  never lose an update.
- Waits are watches, not polls: a ``get`` of an absent key watches it from the revision of the read that missed
  it, so a key written in between is not missed.
- Any member serves any request (etcd forwards writes to its leader, and reads are linearizable). A request to a
  member that does not answer goes to the next endpoint, until the store's timeout: the loss of any one member of
  three, the leader included, costs the requests in flight one retry.
- Each thread has its own HTTP session (``requests`` sessions are not thread-safe).

Keys live under ``namespace`` (one job's keys apart from another's on a shared cluster). Values are bytes.

Limit: when a member dies after applying an ``add`` but before answering, the retry on another member adds again
(etcd's v3 API has no idempotency token); a ``set``, ``delete_key``, ``compare_set`` or queue pop retried is
harmless.
"""
from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

import requests
import torch.distributed as dist
from etcd3gw import exceptions as ex
from etcd3gw.client import Etcd3Client

__all__ = ["DEFAULT_NAMESPACE", "EtcdStore", "normal_spec", "parse_endpoints", "parse_spec"]

logger = logging.getLogger(__name__)

_RETRY_PAUSE_S = 0.05
_LIVE: list[EtcdStore] = []
"""Every store made in this process: a store handed only to torch (``PrefixStore(p, EtcdStore(...))``) would
otherwise be freed while torch still calls it, and its calls would fail with "Not implemented"."""


DEFAULT_NAMESPACE = "ds-recycle"
"""A job's keys live under this namespace when its ``--store`` names none."""


def normal_spec(spec: str) -> str:
    """``spec`` checked and written out whole: ``etcd://h1:p1,h2:p2/namespace`` (ValueError names what is wrong)."""
    if not spec.startswith("etcd://"):
        raise ValueError(f"store {spec!r}: give etcd://HOST:PORT,HOST:PORT,HOST:PORT[/NAMESPACE] (every member of "
                         "the etcd cluster)")
    endpoints, namespace = parse_spec(spec)
    hosts = ",".join(f"{h}:{p}" for h, p in endpoints)
    return f"etcd://{hosts}/{namespace.rstrip('/') or DEFAULT_NAMESPACE}"


def parse_spec(spec: str) -> tuple[list[tuple[str, int]], str]:
    """``"etcd://h1:2379,h2:2379/myjob"``: the endpoints and the namespace (``"myjob/"``; ``""`` without a path)."""
    text = spec.removeprefix("etcd://").strip()
    where, _, path = text.partition("/")
    path = path.strip("/")
    return parse_endpoints(where), f"{path}/" if path else ""


def parse_endpoints(spec: str) -> list[tuple[str, int]]:
    """``"h1:2379,h2:2379"`` (an ``etcd://`` prefix allowed) as ``[(host, port), ...]``; ValueError names what is
    wrong."""
    text = spec.removeprefix("etcd://").strip()
    out: list[tuple[str, int]] = []
    for part in (p.strip() for p in text.split(",")):
        host, sep, port = part.rpartition(":")
        if not part or not sep or not host or not port.isdigit():
            raise ValueError(f"etcd endpoint {part!r} in {spec!r}: give host:port, e.g. etcd://h1:2379,h2:2379,h3:2379")
        out.append((host.strip("[]"), int(port)))
    return out


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key after every key that starts with ``prefix`` (etcd's ``range_end`` for a prefix)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


class EtcdStore(dist.Store):
    """torch's ``Store`` over an etcd cluster (see the module docstring)."""

    def __init__(self, endpoints: Sequence[tuple[str, int]] | str, namespace: str = "",
                 timeout: timedelta = timedelta(seconds=300), request_timeout_s: float = 2.0) -> None:
        super().__init__()
        if isinstance(endpoints, str):  # a spec's path is the namespace, unless one is given
            self.endpoints, from_spec = parse_spec(endpoints)
            namespace = namespace or from_spec
        else:
            self.endpoints = list(endpoints)
        if not self.endpoints:
            raise ValueError("EtcdStore needs at least one endpoint (host, port)")
        self.namespace = namespace.encode()
        self.request_timeout_s = request_timeout_s
        self.set_timeout(timeout)
        self._local = threading.local()
        self._preferred = 0
        """The endpoint that answered last (every thread starts there)."""
        _LIVE.append(self)  # torch's C++ holders (a PrefixStore over it) do not keep the Python object alive

    def clone(self) -> EtcdStore:
        """Another client of the same keys (torch's process groups ask for one of their own)."""
        twin = EtcdStore(self.endpoints, self.namespace.decode(), cast(Any, self).timeout, self.request_timeout_s)
        twin._preferred = self._preferred
        return twin

    def _timeout_s(self) -> float:
        """The store's timeout (``set_timeout``, also when torch's C++ code sets it through a ``PrefixStore``)."""
        return float(cast(Any, self).timeout.total_seconds())

    # ---- the wire ------------------------------------------------------------------------------------------------
    def _client(self, index: int) -> Any:
        clients = getattr(self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = {}
        client = clients.get(index)
        if client is None:
            host, port = self.endpoints[index]
            client = clients[index] = Etcd3Client(host, port, timeout=self.request_timeout_s, api_path="/v3/")
        return client

    def _post(self, path: str, body: dict[str, Any], deadline: float | None = None) -> dict[str, Any]:
        """One request, to the last endpoint that answered, then to the others in turn until ``deadline``."""
        stop = deadline if deadline is not None else time.monotonic() + self._timeout_s()
        start = self._preferred
        attempt = 0
        while True:
            index = (start + attempt) % len(self.endpoints)
            client = self._client(index)
            try:
                answer: dict[str, Any] = client.post(client.get_url(path), json=body)
                self._preferred = index
                return answer
            except (ex.ConnectionFailedError, ex.ConnectionTimeoutError, ex.InternalServerError) as err:
                failure: Exception = err  # a dead member, or one without a leader (an election is under way)
            except ex.Etcd3Exception as err:
                if "leader" not in str(err).lower() and "unavailable" not in str(err).lower():
                    raise
                failure = err
            attempt += 1
            if time.monotonic() >= stop:
                raise dist.DistStoreError(f"etcd at {self._where()}: no member answered {path} within the store's "
                                          f"timeout ({self._timeout_s():.0f} s); last error: {failure}")
            if attempt % len(self.endpoints) == 0:
                time.sleep(_RETRY_PAUSE_S)

    def _where(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def _key(self, key: str | bytes) -> bytes:
        return self.namespace + _bytes(key)

    def _range(self, key: bytes, end: bytes | None = None, limit: int = 0,
               count_only: bool = False) -> tuple[list[dict[str, Any]], int, int]:
        """(kvs, revision of the read, count) for ``key`` or ``[key, end)``."""
        body: dict[str, Any] = {"key": _b64(key)}
        if end is not None:
            body["range_end"] = _b64(end)
        if limit:
            body["limit"] = limit
        if count_only:
            body["count_only"] = True
        answer = self._post("/kv/range", body)
        return answer.get("kvs", []), int(answer["header"]["revision"]), int(answer.get("count", 0))

    def _txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
             failure: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return self._post("/kv/txn", {"compare": compare, "success": success, "failure": failure or []})

    def _watch_once(self, key: bytes, after: int, end: bytes | None, deadline: float) -> None:
        """Return once ``key`` (or a key of ``[key, end)``) is written after revision ``after``, or at ``deadline``
        (at most 5 s: the caller reads again). The watch stream is read in this thread, with a read timeout, so no
        thread outlives the call. A member that fails during the watch ends it early."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        client = self._client(self._preferred)
        create: dict[str, Any] = {"key": _b64(key), "start_revision": after + 1, "filters": ["NODELETE"]}
        if end is not None:
            create["range_end"] = _b64(end)
        wait_s = min(remaining, 5.0)
        try:
            with client.session.post(client.get_url("/watch"), json={"create_request": create}, stream=True,
                                     timeout=(self.request_timeout_s, wait_s)) as stream:
                started = time.monotonic()
                for line in stream.iter_lines():
                    if line and json.loads(line).get("result", {}).get("events"):
                        return
                    if time.monotonic() - started > wait_s:
                        return
        except requests.RequestException as err:  # nothing within the read timeout, or the member went away
            if "timed out" not in str(err).lower():
                logger.debug("etcd watch of %r ended: %s", key, err)
                self._preferred = (self._preferred + 1) % len(self.endpoints)
                time.sleep(_RETRY_PAUSE_S)

    @staticmethod
    def _value(kv: dict[str, Any]) -> bytes:
        return base64.b64decode(kv.get("value", ""))

    # ---- torch.distributed.Store ---------------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._post("/kv/put", {"key": _b64(self._key(key)), "value": _b64(_bytes(value))})

    def get(self, key: str) -> bytes:
        full = self._key(key)
        deadline = time.monotonic() + self._timeout_s()
        while True:
            kvs, revision, _ = self._range(full)
            if kvs:
                return self._value(kvs[0])
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"etcd store: key {key!r} not set within the store's timeout "
                                          f"({self._timeout_s():.0f} s)")
            self._watch_once(full, revision, None, deadline)

    def add(self, key: str, amount: int) -> int:
        full = self._key(key)
        while True:
            kvs, _, _ = self._range(full)
            if kvs and amount == 0:  # a read of a counter (one round trip); an absent key is created below
                return int(self._value(kvs[0]) or b"0")
            if kvs:
                now = int(self._value(kvs[0]) or b"0")
                guard = {"key": _b64(full), "target": "MOD", "result": "EQUAL",
                         "mod_revision": kvs[0]["mod_revision"]}
            else:
                now = 0
                guard = {"key": _b64(full), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            new = now + amount
            put = {"request_put": {"key": _b64(full), "value": _b64(str(new).encode())}}
            if self._txn([guard], [put]).get("succeeded"):
                return new

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        full = self._key(key)
        expected, desired = _bytes(expected_value), _bytes(desired_value)
        if expected:
            guard = {"key": _b64(full), "target": "VALUE", "result": "EQUAL", "value": _b64(expected)}
        else:
            guard = {"key": _b64(full), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        answer = self._txn([guard], [{"request_put": {"key": _b64(full), "value": _b64(desired)}}],
                           [{"request_range": {"key": _b64(full)}}])
        if answer.get("succeeded"):
            return desired
        kvs = answer["responses"][0].get("response_range", {}).get("kvs", [])
        return self._value(kvs[0]) if kvs else expected  # as TCPStore: an absent key answers the expected value

    def check(self, keys: list[str]) -> bool:
        if not keys:
            return True
        answer = self._txn([], [{"request_range": {"key": _b64(self._key(k)), "count_only": True}} for k in keys])
        return all(int(r.get("response_range", {}).get("count", 0)) > 0 for r in answer.get("responses", []))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = timeout.total_seconds() if timeout is not None else self._timeout_s()
        deadline = time.monotonic() + limit
        for key in keys:
            full = self._key(key)
            while True:
                _, revision, count = self._range(full, count_only=True)
                if count:
                    break
                if time.monotonic() >= deadline:
                    raise dist.DistStoreError(f"etcd store: keys {keys!r} not all set within {limit:.0f} s")
                self._watch_once(full, revision, None, deadline)

    def delete_key(self, key: str) -> bool:
        answer = self._post("/kv/deleterange", {"key": _b64(self._key(key))})
        return int(answer.get("deleted", 0)) > 0

    def clear(self) -> int:
        """Delete every key of the namespace (a new job under a name an earlier one used); how many were."""
        if not self.namespace:
            raise ValueError("EtcdStore.clear() without a namespace would delete the whole cluster's keys")
        answer = self._post("/kv/deleterange", {"key": _b64(self.namespace),
                                                "range_end": _b64(_prefix_end(self.namespace))})
        return int(answer.get("deleted", 0))

    def num_keys(self) -> int:
        return self._range(self.namespace or b"\0", _prefix_end(self.namespace) if self.namespace else b"\0",
                           count_only=True)[2]

    # ---- queues ---------------------------------------------------------------------------------------------------
    def _queue(self, key: str) -> bytes:
        return self._key(key) + b"\0queue/"

    def queue_push(self, key: str, value: str | bytes) -> None:
        number = self.add(key + "\0queue-tail", 1)
        self._post("/kv/put", {"key": _b64(self._queue(key) + b"%020d" % number), "value": _b64(_bytes(value))})

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        prefix = self._queue(key)
        end = _prefix_end(prefix)
        deadline = time.monotonic() + self._timeout_s()
        while True:
            kvs, revision, _ = self._range(prefix, end, limit=1)
            if kvs:
                head = kvs[0]
                guard = {"key": head["key"], "target": "MOD", "result": "EQUAL", "mod_revision": head["mod_revision"]}
                if self._txn([guard], [{"request_delete_range": {"key": head["key"]}}]).get("succeeded"):
                    return self._value(head)
                continue  # another client popped it first
            if not block:
                raise dist.DistStoreError(f"etcd store: queue {key!r} is empty")
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"etcd store: queue {key!r} stayed empty for the store's timeout "
                                          f"({self._timeout_s():.0f} s)")
            self._watch_once(prefix, revision, end, deadline)

    def queue_len(self, key: str) -> int:
        prefix = self._queue(key)
        return self._range(prefix, _prefix_end(prefix), count_only=True)[2]
