"""The `ds-recycle` command line: one entry point, one sub-command per concern.

Each sub-command lives in the module that owns its concern and exposes two functions::

    add_arguments(parser: argparse.ArgumentParser) -> None
    run(args: argparse.Namespace) -> int          # the process exit status

Modules are imported only when their sub-command runs, so `ds-recycle plan` never imports torch.

    ds-recycle launch --num_accelerators 4 launch/train.py --deepspeed_config configs/gpt_cpu_2x2.json
    ds-recycle restart --master_addr 10.0.0.1 --master_port 29500 3
    ds-recycle store --port 29500          # on a host with no workers; launchers then add --store_service
    ds-recycle compare a.pt b.pt --rtol 1e-5
    ds-recycle plan --stages 4 --pipelines 2 --microbatches 8 --fail 1:2
    ds-recycle simulate --trace ../shared/traces/oobleck/1h.csv --model gpt3-medium
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

#: sub-command -> (module that implements it, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "launch": ("ds_recycle.launcher.cli", "start workers that survive each other's failures"),
    "restart": ("ds_recycle.launcher.restart_cmd", "restart lost ranks of a running `launch` job now"),
    "store": ("ds_recycle.launcher.store_cmd", "host a job's store as a service that outlives every node"),
    "compare": ("ds_recycle.tools.compare", "compare two --save-final parameter files"),
    "plan": ("ds_recycle.plan.cli", "make, validate, simulate and draw a ReCycle plan"),
    "simulate": ("ds_recycle.cluster.cli", "simulate a cluster over a failure trace"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds-recycle", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        build_parser().parse_args(argv)  # prints help or "invalid choice" and exits
        return 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"ds-recycle {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    return int(module.run(args))


def console() -> NoReturn:
    """The ``ds-recycle`` console script: :func:`main`, then leave without the interpreter's module teardown
    (:mod:`ds_recycle.launcher.leave`: a launcher that imported torch spends seconds in it after its job ended)."""
    from ds_recycle.launcher.leave import leave

    try:
        code = main()
    except SystemExit as stop:
        leave(stop.code)
    leave(code)


if __name__ == "__main__":
    console()
