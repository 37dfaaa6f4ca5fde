"""The ``infinity`` command line: ``infinity demo`` (and ``python -m infinity demo``)."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="infinity",
                                     description="GPU/CPU/NVMe offload engine for PyTorch")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine decisions")
    sub = parser.add_subparsers(dest="command", required=True)
    from . import demo
    demo_parser = sub.add_parser("demo", help="train a small GPT with everything offloaded to "
                                              "a swap directory and show what moved where")
    demo.add_arguments(demo_parser)
    sub.add_parser("info", help="native core, CPU capability and I/O settings")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        losses = demo.run(args, sys.stdout.write)
        return 0 if losses[-1] < losses[0] else 1
    if args.command == "info":
        from . import _native, io, ops
        sys.stdout.write(f"native core: {'loaded' if _native.available() else _native.load_error()}\n"
                         f"CPU Adam path: {ops.cpu_capability()} "
                         f"(available: {', '.join(ops.available_cpu_capabilities())})\n"
                         f"I/O settings: {io.get_config()}\n")
        return 0
    return 2
