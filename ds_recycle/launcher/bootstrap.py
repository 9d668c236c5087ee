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
that does not use DeepSpeed pays nothing.
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
    if as_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python script.py` does
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
