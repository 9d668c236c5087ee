"""What ``ds-recycle launch`` runs in each worker around the user's script: ``python -m ds_recycle.launcher.bootstrap``.

    python -u -m ds_recycle.launcher.bootstrap train.py --deepspeed_config ds.json        # a script
    python -u -m ds_recycle.launcher.bootstrap -m my_pkg.train --deepspeed_config ds.json  # a module

It runs the script as ``__main__`` with its own ``sys.argv``, after arranging that DeepSpeed's
``init_distributed`` (``deepspeed.init_distributed()``, ``deepspeed.comm.init_distributed()``, and the call
``deepspeed.initialize`` makes when the script made none) starts the process group the way a job that
survives failures needs (:func:`ds_recycle.resilience.world.init_worker`): a rank restarted while the others
train starts on a detached WORLD, a job that fell back to a checkpoint starts under a fresh store prefix,
DeepSpeed's CPU shared-memory op is not JIT-compiled, and a CPU worker computes on one thread. The script's
``PipelineModule`` construction (with its group creations) then runs unchanged, also in a restarted worker:
nothing in the user's script changes. DeepSpeed is patched when the script first imports it, so a script
that does not use DeepSpeed pays nothing. Once the script is done (returned or called ``sys.exit``), the worker
leaves through :func:`ds_recycle.launcher.leave.leave`: threads joined, ``atexit`` run, files flushed, the same
exit status, without the seconds of module teardown.
"""
from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys
from collections.abc import Sequence
from datetime import timedelta
from types import ModuleType
from typing import Any

from ds_recycle._after_import import after_import

__all__ = ["install_deepspeed_hook", "main"]

_USAGE = "usage: python -m ds_recycle.launcher.bootstrap [-m MODULE | SCRIPT] [ARGS...]"


def _recycle_init_distributed(*args: Any, **kwargs: Any) -> None:
    """``deepspeed.init_distributed`` under ``ds-recycle launch``: :func:`~ds_recycle.resilience.world.init_worker`
    (same arguments accepted)."""
    from ds_recycle.resilience.world import init_worker

    timeout = kwargs.get("timeout")
    init_worker(timeout_s=timeout.total_seconds() if isinstance(timeout, timedelta) else 600.0)


def _ended_start_up(initialize: Any) -> Any:
    """``deepspeed.initialize`` that ends the start-up once DeepSpeed's engine is built (a stock script has no
    failure handler: a loss after that is not met by restarting every rank)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        built = initialize(*args, **kwargs)
        from ds_recycle.resilience.world import end_start_up_without_handler

        end_start_up_without_handler()
        return built
    run.__wrapped__ = initialize  # type: ignore[attr-defined]
    return run


def _patch(deepspeed: ModuleType) -> None:
    deepspeed.init_distributed = _recycle_init_distributed  # type: ignore[attr-defined]
    deepspeed.comm.init_distributed = _recycle_init_distributed
    deepspeed.initialize = _ended_start_up(deepspeed.initialize)  # type: ignore[attr-defined]


def install_deepspeed_hook() -> None:
    """Route DeepSpeed's ``init_distributed`` through :func:`~ds_recycle.resilience.world.init_worker` (now, or
    when DeepSpeed is imported)."""
    after_import("deepspeed", _patch, "ds_recycle: init_distributed")


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    as_module = bool(args) and args[0] == "-m"
    if as_module:
        args = args[1:]
    if not args:
        sys.stderr.write(_USAGE + "\n")
        raise SystemExit(2)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>`: every thread's Python stack to stderr, for hangs
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    install_deepspeed_hook()
    target = args[0]
    sys.argv = args
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python script.py` does
            runpy.run_path(target, run_name="__main__")
    except Exception as error:
        _leave_as_lost_on_a_sticky_device_error(error)
        _leave_as_lost_if_a_peer_died_in_start_up()
        raise


def _leave_as_lost_on_a_sticky_device_error(error: BaseException) -> None:
    """The script raised a sticky CUDA error (:mod:`ds_recycle.resilience.device_errors`): under ``ds-recycle
    launch`` this worker leaves as lost at once (no teardown: the device would fail it), so that its peers go on
    without it and the launcher's restart brings it back on a fresh CUDA context."""
    from ds_recycle.resilience.checkpoint import LOST_EXIT_CODE
    from ds_recycle.resilience.device_errors import sticky_device_error
    from ds_recycle.resilience.world import under_recycle_launcher

    what = sticky_device_error(error)
    if what is None or not under_recycle_launcher():
        return
    import traceback

    traceback.print_exc()
    sys.stderr.write(f"ds_recycle: sticky CUDA error ({what}): this process cannot use its GPU again; leaving as "
                     f"lost (exit {LOST_EXIT_CODE}) for the launcher to restart it and the job to take it back\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(LOST_EXIT_CODE)


def _leave_as_lost_if_a_peer_died_in_start_up() -> None:
    """The script raised: if that was during the start-up and a peer's death explains it, leave as lost (the
    start-up restarts with every rank) instead of failing the job. The wait covers a host's loss, which the
    launchers declare after their node timeout; on one host a death is reported within milliseconds."""
    from ds_recycle.launcher.hosts import Layout
    from ds_recycle.launcher.hostwatch import LAYOUT_KEY, NODE_TIMEOUT_KEY
    from ds_recycle.resilience.checkpoint import LOST_EXIT_CODE
    from ds_recycle.resilience.store import connect_store
    from ds_recycle.resilience.world import peer_lost_in_start_up, under_recycle_launcher

    if not under_recycle_launcher():
        return
    try:
        store = connect_store()
        several = (store.check([LAYOUT_KEY, NODE_TIMEOUT_KEY])
                   and len(Layout.decode(store.get(LAYOUT_KEY).decode()).nodes) > 1)
        wait_s = float(store.get(NODE_TIMEOUT_KEY).decode()) + 3.0 if several else 2.0
        lost = peer_lost_in_start_up(wait_s)
    except Exception:  # noqa: BLE001 (the store is gone too: the original error is what to report)
        return
    if lost:
        import traceback

        traceback.print_exc()
        sys.stderr.write(f"ds_recycle: a peer was lost during the start-up: leaving as lost (exit {LOST_EXIT_CODE}) "
                         "for the start-up to begin again\n")
        sys.stderr.flush()
        os._exit(LOST_EXIT_CODE)


if __name__ == "__main__":
    from ds_recycle.launcher.leave import leave

    try:
        main()
    except SystemExit as stop:
        leave(stop.code)
    leave(0)
