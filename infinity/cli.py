"""The ``infinity`` command line (also ``python -m infinity``): demo, info, consolidate,
ckpt inspect, probe, estimate, explain and bench."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="infinity", description="GPU/CPU/NVMe offload engine for PyTorch"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine decisions")
    sub = parser.add_subparsers(dest="command", required=True)
    from . import demo

    demo_parser = sub.add_parser(
        "demo",
        help="train a small GPT with everything offloaded to "
        "a swap directory and show what moved where",
    )
    demo.add_arguments(demo_parser)
    sub.add_parser("info", help="native core, CPU capability and I/O settings")
    cons = sub.add_parser(
        "consolidate",
        help="write a checkpoint's model as safetensors in its "
        "own parameter names (+ config.json for "
        "transformers models)",
    )
    cons.add_argument("checkpoint", help="a directory written by infinity.save_checkpoint")
    cons.add_argument("out", help="output directory")
    cons.add_argument(
        "--dtype",
        default=None,
        choices=["bf16", "fp16", "fp32"],
        help="cast floating-point weights (default: as saved)",
    )
    cons.add_argument(
        "--max-shard-size",
        default="5GB",
        help="split into shards above this size, e.g. 5GB (default) or 500MB",
    )
    cons.add_argument(
        "--quantize",
        default=None,
        choices=["nf4", "nf4-dq"],
        help="the layers' linear weights in bitsandbytes' 4-bit format (nf4-dq: "
        "double-quantized scales), loadable by transformers and wrap(source=)",
    )
    ckpt = sub.add_parser("ckpt", help="checkpoint tools").add_subparsers(
        dest="ckpt_command", required=True
    )
    insp = ckpt.add_parser("inspect", help="what a checkpoint holds and whether it verifies")
    insp.add_argument("path", help="a directory written by infinity.save_checkpoint")
    insp.add_argument("--no-verify", action="store_true", help="skip reading every file")
    insp.add_argument("--json", action="store_true", help="print the summary as JSON")
    from .bench import cli as bench_cli

    bench_cli.add_probe(
        sub.add_parser(
            "probe",
            help="measure this machine (under a minute, then cached): memory, host<->device, "
            "swap disk, CPU Adam, compute rates",
        )
    )
    bench_cli.add_estimate(
        sub.add_parser(
            "estimate", help="bytes per tier and predicted step time of a model, per placement"
        )
    )
    bench_cli.add_bench(
        sub.add_parser(
            "bench",
            help="the GPT offload benchmark: a ladder of sizes x placements, tokens/s, memory",
        )
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.command == "demo":
        losses = demo.run(args, sys.stdout.write)
        return 0 if losses[-1] < losses[0] else 1
    if args.command == "info":
        from . import _native, io, ops

        sys.stdout.write(
            f"native core: {'loaded' if _native.available() else _native.load_error()}\n"
            f"CPU Adam path: {ops.cpu_capability()} "
            f"(available: {', '.join(ops.available_cpu_capabilities())})\n"
            f"I/O settings: {io.get_config()}\n"
        )
        return 0
    if args.command == "consolidate":
        from .checkpoint import CheckpointError, consolidate

        try:
            written = consolidate(
                args.checkpoint,
                args.out,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size,
                quantize=args.quantize,
            )
        except (CheckpointError, OSError, ValueError) as exc:
            sys.stderr.write(f"infinity consolidate: {exc}\n")
            return 1
        sys.stdout.write("".join(f"wrote {p}\n" for p in written))
        return 0
    if args.command == "ckpt":
        import json as _json

        from .checkpoint import CheckpointError
        from .checkpoint.inspect import format_inspection, inspect_checkpoint

        try:
            info = inspect_checkpoint(args.path, verify=not args.no_verify)
        except (CheckpointError, OSError, ValueError) as exc:
            sys.stderr.write(f"infinity ckpt inspect: {exc}\n")
            return 1
        sys.stdout.write(
            _json.dumps(info, indent=2) + "\n" if args.json else format_inspection(info)
        )
        return 0 if info["verified"] is not False else 1
    if args.command == "probe":
        return bench_cli.run_probe(args)
    if args.command == "estimate":
        return bench_cli.run_estimate(args)
    if args.command == "bench":
        return bench_cli.run_bench_cli(args)
    return 2
