"""A job's namespace on etcd: who clears it, and when the other nodes may join it.

With ``--store etcd://...`` the job's keys live under one namespace of the etcd cluster. A one-host job clears
it as it starts (a name an earlier job used). With several hosts, several launchers start at about the same
time and none of them may wipe what another already wrote, so the namespace follows the job's own keys:

- **node 0** clears the namespace when it holds no job (no ``ds_recycle/layout``) or a job that is over
  (``ds_recycle/job_over``, written by every launcher that reports the job's status). A namespace holding a job
  that is not over is joined as it is: node 0's launcher is then a returning one (its host was lost) and waits to
  be declared lost, see :mod:`.hostwatch`; if that job is in fact dead (every launcher of it was killed), the
  returning launcher gives up and says to delete the namespace or name another.
- **every other node** waits (up to ``--store_timeout``) until node 0 has written the layout of a job that is
  not over, then announces itself in ``ds_recycle/node/<k>``. An earlier job's keys are therefore never joined,
  and node 0's clearing never removes a newer node's announcement.

Give each job its own namespace where jobs overlap on one cluster (``etcd://.../NAME``), as torchrun's
``--rdzv_id`` names one rendezvous.
"""
from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta

from ds_recycle.launcher.hostwatch import LAYOUT_KEY, node_hb_key
from ds_recycle.launcher.job import JobSpec
from ds_recycle.runtime import job_store as keys
from ds_recycle.runtime.etcd_store import EtcdStore

__all__ = ["open_etcd_job"]

logger = logging.getLogger(__name__)

_POLL_S = 0.1


def open_etcd_job(job: JobSpec, timeout_s: float) -> EtcdStore:
    """This launcher's client of the job's namespace, the namespace made ready as the module docstring says.
    OSError names what went wrong (no member answered; node 0 did not open the job in time)."""
    assert job.store is not None
    store = EtcdStore(job.store, timeout=timedelta(seconds=timeout_s))
    try:
        if len(job.layout.nodes) == 1:
            logger.info("etcd store %s: namespace cleared (%d keys of an earlier job)", job.store, store.clear())
        elif job.node_rank == 0:
            _open_as_node0(store, job)
        else:
            _wait_for_node0(store, job, timeout_s)
        store.set(keys.node_key(job.node_rank), socket.gethostname())
    except RuntimeError as err:  # DistStoreError: no member answered within the timeout
        raise OSError(f"--store {job.store}: {err}") from err
    return store


def _job_live(store: EtcdStore) -> bool:
    return bool(store.check([LAYOUT_KEY])) and not store.check([keys.JOB_OVER_KEY])


def _open_as_node0(store: EtcdStore, job: JobSpec) -> None:
    if _job_live(store):
        beats = store.add(node_hb_key(0), 0)
        logger.warning("etcd store %s holds a job that is not over (node 0 beat %d time(s) in it): joining it as a "
                       "returning node 0; if that job is dead, delete the namespace (etcdctl del --prefix) or give "
                       "another (etcd://.../NAME)", job.store, beats)
        return
    stale = store.clear()
    store.set(LAYOUT_KEY, job.layout.encode())  # the other nodes join once this is there
    logger.info("etcd store %s: namespace cleared (%d keys of an earlier job) and opened", job.store, stale)


def _wait_for_node0(store: EtcdStore, job: JobSpec, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _job_live(store):
        if time.monotonic() > deadline:
            raise OSError(f"--store {job.store}: node 0 did not open the job within {timeout_s:.0f} s (--store_timeout):"
                          " start its launcher, or check that every node names the same namespace")
        time.sleep(_POLL_S)
    layout = store.get(LAYOUT_KEY).decode()
    if layout != job.layout.encode():
        raise OSError(f"--store {job.store}: node 0 opened a job of another layout ({layout!r}); give every node the "
                      "same hostfile and options")
