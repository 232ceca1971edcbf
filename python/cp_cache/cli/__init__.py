"""Command line of cp_cache: ``cp-cache`` (or ``python -m cp_cache``) ``demo | bench | compare | doctor | selftest``.

* ``demo``: trains a tiny decoder under context parallelism (2 CPU ranks by
  default) with full activation checkpointing and dropout, under the handle and
  the stack policy, and prints loss parity and step-cache liveness per step;
* ``bench``: memory, overhead, traffic and accuracy figures, JSON + PNG;
* ``compare``: cp_cache next to torch_npu 2.13.0 / 2.12.0 and torch's own ring on the same
  emulated kernels: correctness, dropout gradients, memory, time, traffic, JSON + PNG;
* ``doctor``: what is installed, built and in use, and what to do about it;
* ``selftest``: every algorithm and feature on this machine's devices (under torchrun) or on
  spawned CPU ranks, against one-device attention; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from . import bench, compare, demo, doctor, selftest

    prog = "cp-cache" if os.path.basename(sys.argv[0]) == "cp-cache" else "python -m cp_cache"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", metavar="{demo,bench,compare,doctor,selftest}")
    for module in (demo, bench, compare, doctor, selftest):
        sub = commands.add_parser(module.NAME, help=module.HELP, description=getattr(module, "DESCRIPTION", module.__doc__),
                                  formatter_class=argparse.RawDescriptionHelpFormatter if hasattr(module, "DESCRIPTION")
                                  else argparse.HelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
