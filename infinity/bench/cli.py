"""Arguments and main of ``infinity probe``, ``infinity estimate`` and ``infinity bench``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def add_probe(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nvme-path", default=None, help="the swap directory to measure")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--quick", action="store_true", help="small buffers: seconds, rougher")
    how.add_argument(
        "--thorough",
        action="store_true",
        help="time every layer width in fp32 and bf16 however long it takes (minutes on a "
        "CPU without fast bf16); by default each dtype stops at its time budget",
    )
    p.add_argument("--refresh", action="store_true", help="measure again even if cached")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bars (on stderr) while measuring"
    )


def run_probe(args: argparse.Namespace) -> int:
    from ..plan.probe import ProbeError, format_probe, probe

    try:
        r = probe(
            args.nvme_path,
            quick=args.quick,
            refresh=args.refresh,
            thorough=args.thorough,
            progress=not args.no_progress,
        )
    except ProbeError as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    sys.stdout.write(json.dumps(r.to_json(), indent=1) + "\n" if args.json else format_probe(r))
    return 0


def add_estimate(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "params",
        nargs="?",
        default=None,
        help="parameter count of a GPT, e.g. 125M, 2B, 1.3e9 (or give the model's "
        "shape: --config, or --d-model --layers --heads --ffn --vocab ...)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="a Hugging Face config.json (or the model folder holding it) of a "
        "Llama-style decoder; the flags below override its values",
    )
    p.add_argument("--layers", type=int, default=None, help="num_hidden_layers")
    p.add_argument("--d-model", type=int, default=None, help="hidden_size")
    p.add_argument("--heads", type=int, default=None, help="num_attention_heads")
    p.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help="num_key_value_heads (grouped-query attention; default: --heads)",
    )
    p.add_argument("--head-dim", type=int, default=None, help="head_dim (default d_model/heads)")
    p.add_argument("--ffn", type=int, default=None, help="intermediate_size (gate/up/down MLP)")
    p.add_argument("--vocab", type=int, default=None, help="vocab_size")
    p.add_argument(
        "--tied",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="lm_head tied to the embedding (tie_word_embeddings; default: the "
        "config's, else untied)",
    )
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="micro-batches of --batch x --seq per optimizer step (default 1)",
    )
    p.add_argument(
        "--layer-major",
        action="store_true",
        help="price the micro-batches as infinity.accumulate runs them (each block read "
        "once for forward and once for backward) instead of the plain loop",
    )
    p.add_argument(
        "--activation-tier",
        choices=("host", "nvme"),
        default="host",
        help="with --layer-major: the layer inputs kept for backward in host RAM or on the "
        "swap disk (wrap(activation_tier=...))",
    )
    p.add_argument("--ranks", type=int, default=1, help="rows for 1..N ranks")
    p.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="the link between ranks (Gb/s): lists ZeRO-3's bytes and time on it per step",
    )
    p.add_argument(
        "--comm",
        choices=("none", "int8", "int4"),
        default="int8",
        help="the compressed collectives compared with full width (wrap(comm=...))",
    )
    p.add_argument("--nvme-path", default=None)
    p.add_argument(
        "--placement", action="append", default=None, help="only this placement (repeatable)"
    )
    p.add_argument("--quick-probe", action="store_true")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="time one layer + head at this shape instead of the probe's FLOP rate",
    )
    p.add_argument(
        "--master",
        choices=("fp32", "bf16_sr", "bf16_kahan"),
        default="fp32",
        help="the optimizer's master weights (AdamW(master=...))",
    )
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="the weights' dtype of a config or a count (bf16 as published: homes in "
        "2 bytes a parameter, computed at the probe's bf16 rate)",
    )
    p.add_argument(
        "--tiled-head",
        action="store_true",
        help="the LM head and its loss in vocabulary tiles (wrap(tiled_head=True)): "
        "counts one tile of the head in RAM instead of the whole logits",
    )
    p.add_argument(
        "--whole-embedding",
        action="store_true",
        help="fetch the input embedding whole instead of reading its batch's rows "
        "(wrap(embedding_rows=False)): counts its dense gradient",
    )
    p.add_argument("--plan", action="store_true", help="also show the planner's choice")
    p.add_argument("--ram-budget", default=None, help="host budget for --plan, e.g. 8GiB")


def estimate_shape(args: argparse.Namespace):
    """The ModelShape the estimate flags describe: a count (a GPT), a config, or dimensions."""
    from ..plan.shape import describe

    if args.params is not None and args.config is not None:
        raise ValueError(
            f"infinity estimate: give a parameter count ({args.params}) or "
            f"--config ({args.config}), not both"
        )
    dims = dict(
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        ffn=args.ffn,
        vocab_size=args.vocab,
        tied=args.tied,
    )
    if args.params is None and args.config is None and all(v is None for v in dims.values()):
        raise ValueError(
            "infinity estimate: describe the model: a parameter count (e.g. 2B), "
            "--config path/to/config.json, or --d-model --layers --heads --ffn "
            "--vocab [--kv-heads --tied]"
        )
    if args.config is not None:
        source = args.config
    elif args.params is not None:
        from ..plan.shape import parse_count

        source = parse_count(args.params)
    else:
        source = None
    bpp = 2 if getattr(args, "dtype", "fp32") == "bf16" else 4
    return describe(source, bytes_per_param=bpp, **dims)


def run_estimate(args: argparse.Namespace) -> int:
    from ..plan import estimate, plan
    from ..plan.probe import ProbeError, probe
    from ..sizes import parse_budget

    try:
        budget = parse_budget(args.ram_budget, "--ram-budget") if args.ram_budget else None
        shape = estimate_shape(args)
        # no cached probe: measured first, said so on stderr, with progress bars
        pr = probe(
            args.nvme_path, quick=args.quick_probe, progress=True, announce="infinity estimate"
        )
        layout = dict(tiled_head=args.tiled_head, embedding_rows=not args.whole_embedding)
        table = estimate(
            shape,
            batch=args.batch,
            seq=args.seq,
            ranks=args.ranks,
            placements=args.placement,
            probe=pr,
            calibrate=args.calibrate,
            master=args.master,
            micro_batches=args.micro_batches,
            layer_major=args.layer_major,
            activation_tier=args.activation_tier,
            link_gbps=args.link_gbps,
            comm=args.comm,
            **layout,
        )
        sys.stdout.write(str(table))
        if args.plan:
            sys.stdout.write(
                str(
                    plan(
                        shape,
                        probe=pr,
                        nvme_path=args.nvme_path,
                        host_budget=budget,
                        batch=args.batch,
                        seq=args.seq,
                        **layout,
                    )
                )
            )
    except (ValueError, OSError, ProbeError) as exc:  # PlanError is a ValueError
        sys.stderr.write(f"{exc}\n")
        return 1
    return 0


def add_bench(p: argparse.ArgumentParser) -> None:
    from .models import DEFAULT_LADDER

    p.add_argument(
        "--size",
        action="append",
        default=None,
        help=f"a ladder rung (repeatable), e.g. 125M, 2B (default: {' '.join(DEFAULT_LADDER)})",
    )
    p.add_argument(
        "--placement",
        action="append",
        default=None,
        help="only this placement (repeatable; default: all)",
    )
    p.add_argument("--no-planner", action="store_true", help="skip the planner's run")
    p.add_argument(
        "--nvme-path",
        default=None,
        help="swap directory (default: a new folder in the temp dir, removed after)",
    )
    p.add_argument(
        "--ram-budget", default=None, help="host RAM budget, e.g. 8GiB (the engine's host_budget)"
    )
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first, per run")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs per cell, interleaved (default 2; 1 with --quick); the cell's "
        "step time is the median of all their measured steps",
    )
    p.add_argument(
        "--states",
        choices=("fp32", "bf16", "8bit"),
        default=None,
        help="optimizer states format of every infinity placement (and the "
        "planner's); default: each placement's own (fp32, nvme_bf16, nvme_8bit)",
    )
    p.add_argument(
        "--calibrate-in-run",
        action="store_true",
        help="also time one layer inside each run (a diagnostic column, not used "
        "by the prediction)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--out", default="infinity_bench", help="output directory")
    p.add_argument("--report", action="store_true", help="print a pasteable summary")
    p.add_argument("--load", default=None, help="report on a saved bench.json, no run")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny models, quick probe: a smoke test in well under a minute",
    )


def run_bench_cli(args: argparse.Namespace) -> int:
    import shutil

    from ..sizes import parse_budget
    from . import BenchConfig, report, run_bench, save
    from .models import DEFAULT_LADDER, QUICK_LADDER, QUICK_PLACEMENTS

    if args.load:
        with open(args.load) as fh:
            sys.stdout.write(report(json.load(fh)))
        return 0
    own = args.nvme_path is None
    path = tempfile.mkdtemp(prefix="infinity-bench-") if own else args.nvme_path
    try:
        sizes = args.size or list(QUICK_LADDER if args.quick else DEFAULT_LADDER)
        cfg = BenchConfig(
            sizes=sizes,
            nvme_path=path,
            planner=not args.no_planner,
            batch=args.batch,
            seq=32 if args.quick and args.seq == 128 else args.seq,
            steps=args.steps,
            warmup=args.warmup,
            repeats=args.repeats or (1 if args.quick else 2),
            states=args.states,
            calibrate_in_run=args.calibrate_in_run,
            ram_budget=(parse_budget(args.ram_budget, "--ram-budget") if args.ram_budget else None),
            timeout_s=args.timeout,
            quick_probe=args.quick,
        )
        cfg.runs_log = os.path.join(args.out, "runs.jsonl")
        if os.path.exists(cfg.runs_log):
            os.remove(cfg.runs_log)  # this bench's runs only
        if args.placement:
            cfg.placements = args.placement
        elif args.quick:
            cfg.placements = QUICK_PLACEMENTS
        result = run_bench(cfg)
    except ValueError as exc:
        sys.stderr.write(f"infinity bench: {exc}\n")
        return 1
    finally:
        if own:
            shutil.rmtree(path, ignore_errors=True)
    for f in save(result, args.out):
        sys.stdout.write(f"wrote {os.path.abspath(f)}\n")
    if args.report:
        sys.stdout.write(report(result))
    failed = [r for r in result["rows"] if r.get("error")]
    return 1 if failed else 0
