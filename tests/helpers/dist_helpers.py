"""Helpers for the ZeRO tests: launch N ranks (gloo, CPU) as subprocesses of this file, each
running one scenario, and collect what each rank saved.

    results = run_ranks("train", world=2, opts={...}, tmp=tmp_path)

A scenario runs with ``world=1`` without torch.distributed at all (the single-process
reference). Every rank uses one CPU thread (the test machine has two cores).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, world: int, opts: Dict[str, Any], tmp: Path,
              timeout: float = 120.0, dist: bool = True) -> List[Dict[str, Any]]:
    """Runs ``scenario`` on ``world`` ranks; returns each rank's saved dict (torch.load).
    Raises with every rank's stderr tail when one fails or the time runs out."""
    import torch
    out = Path(tmp) / f"{scenario}-{world}-{int(time.time() * 1e6)}"
    out.mkdir(parents=True)
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE=str(world), OMP_NUM_THREADS="1", INFINITY_DEVICE="cpu",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    for rank in range(world):
        env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        cmd = [sys.executable, str(Path(__file__).resolve()), scenario, str(out),
               json.dumps(opts), "1" if dist else "0"]
        err = open(out / f"stderr{rank}.txt", "w")
        procs.append((subprocess.Popen(cmd, env=env_r, cwd=str(ROOT), stdout=err,
                                       stderr=subprocess.STDOUT), err))
    deadline = time.monotonic() + timeout
    codes = []
    for p, err in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            codes.append(None)
        err.close()
    tails = "\n".join(f"--- rank {r} (exit {c}) ---\n"
                      + (out / f"stderr{r}.txt").read_text()[-3000:]
                      for r, c in enumerate(codes))
    if any(c is None for c in codes):
        raise TimeoutError(f"ranks did not finish within {timeout} s\n{tails}")
    results = []
    for r in range(world):
        f = out / f"rank{r}.pt"
        if not f.exists():
            raise RuntimeError(f"rank {r} saved nothing\n{tails}")
        results.append(torch.load(f, weights_only=False))
    for r, res in enumerate(results):
        res["exit_code"] = codes[r]
        res["log"] = (out / f"stderr{r}.txt").read_text()
    return results


# ==========================================================================================
# inside a rank
# ==========================================================================================
def _model(width: int = 24, hidden: int = 37, layers: int = 3, big: int = 0):
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(width, hidden)
            self.down = nn.Linear(hidden, width)

        def forward(self, x):
            return x + self.down(torch.tanh(self.up(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(8, width)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.head = nn.Linear(width, 4)
            self.skip: List[int] = []  # layers this rank skips (divergence test)

        def forward(self, x):
            h = self.embed(x)
            for i, layer in enumerate(self.layers):
                if i not in self.skip:
                    h = layer(h)
            return self.head(h)

    if big:
        width, hidden = big, big
    return Net()


def _mean_loss(loss: Any, world: int) -> float:
    """The step's loss averaged over the ranks (this rank's own outside a process group)."""
    import torch.distributed as dist
    value = loss.detach().clone()
    if world > 1 and dist.is_initialized():
        dist.all_reduce(value)
        value /= world
    return float(value)


def _scenario_train(rank: int, world: int, out: Path, opts: Dict[str, Any]) -> Dict[str, Any]:
    import resource

    import torch

    import infinity
    from infinity.runtime.engine import engine_of

    steps = opts.get("steps", 10)
    torch.manual_seed(0)
    model = _model(layers=opts.get("layers", 3), big=opts.get("big", 0))
    batch = opts.get("batch", 6)
    xs = torch.randn(steps, batch, 8, generator=torch.Generator().manual_seed(1))
    ys = torch.randn(steps, batch, 4, generator=torch.Generator().manual_seed(2))
    settings = dict(opts.get("settings", {}))
    nvme = settings.pop("nvme", False)
    if isinstance(settings.get("compute_dtype"), str):
        settings["compute_dtype"] = getattr(torch, settings["compute_dtype"])
    settings.update(opts.get("rank_settings", {}).get(str(rank), {}))
    if opts.get("no_all_to_all"):  # a backend without all-to-all
        import torch.distributed as dist

        def refuse(*args, **kwargs):
            raise RuntimeError("all_to_all is not supported by this backend (injected)")
        dist.all_to_all_single = refuse
    if isinstance(settings.get("comm"), dict):
        settings["comm"] = infinity.CommPolicy(**settings["comm"])
    if opts.get("in_backward"):  # why a step is not taken in backward is logged at INFO
        import logging
        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("infinity.optim").setLevel(logging.INFO)
    if rank in opts.get("refuse_in_backward_ranks", []):  # this rank cannot step in backward
        from infinity.optim.in_backward import StepInBackward
        StepInBackward.why_not = staticmethod(lambda core, port: "a reason (injected)")
    if world == 1:
        settings.pop("shard", None)  # the single-process reference
    if nvme:
        settings["nvme_path"] = str(out)
    pg = None
    if opts.get("mesh") and world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        pg = init_device_mesh("cpu", tuple(opts["mesh"]), mesh_dim_names=("rep", "shard"))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    infinity.wrap(model, process_group=pg, **settings)
    engine = engine_of(model)
    opt = infinity.optim.AdamW(model.parameters(), lr=opts.get("lr", 1e-2),
                               weight_decay=0.01, **opts.get("optim", {}))
    if opts.get("load_from"):  # resume from whole state dicts saved by any number of ranks
        from infinity.sharding import load_full_optimizer_state_dict, load_full_state_dict
        saved = torch.load(opts["load_from"], weights_only=False)
        load_full_state_dict(model, saved["model"])
        load_full_optimizer_state_dict(opt, saved["optim"])
    sched = None
    if opts.get("sched"):  # an LR scheduler stepped with the optimizer
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    loaded_extra = None
    if opts.get("load_sharded_from"):  # one file per rank, saved by any number of ranks
        # infinity.load_checkpoint dispatches to infinity.sharding.load_sharded for these
        loaded_extra = infinity.load_checkpoint(opts["load_sharded_from"], model, opt,
                                                scheduler=sched,
                                                rng=bool(opts.get("rng")))
        if opts.get("rng"):
            loaded_extra = dict(loaded_extra, draw=float(torch.rand(1)))
    per = batch // world
    losses = []
    result_steps = []  # per step: the bytes moved, the blocks stepped in backward
    for step in range(opts.get("start", 0), opts.get("stop", steps)):
        x = xs[step, rank * per:(rank + 1) * per]
        y = ys[step, rank * per:(rank + 1) * per]
        if rank in opts.get("skip_ranks", []) and step == opts.get("skip_step", 0):
            model.skip = [opts.get("skip_layer", 1)]
        if rank in opts.get("raise_ranks", []) and step == opts.get("raise_step", 0):
            raise RuntimeError(f"boom on rank {rank}")
        if rank in opts.get("full_disk_ranks", []) and step == opts.get("full_disk_step", 0):
            # from this step on, this rank's optimizer state writes find the disk full
            import errno

            from infinity.optim.states.extents import StateExtents

            def full(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            StateExtents.write_unit = full
        micro = opts.get("micro", 1)  # gradient accumulation over micro-batches
        if rank in opts.get("extra_micro_ranks", []):
            micro += 1  # this rank was given one micro-batch more (a refused layer-major step)
        loss = 0.0
        if opts.get("layer_major"):  # infinity.accumulate over the same micro-batches
            xms, yms = list(x.chunk(micro)), list(y.chunk(micro))
            target = {id(xm): ym for xm, ym in zip(xms, yms)}
            # in_backward: the whole step, each block stepped as its gradients complete
            whole = opts.get("in_backward", False)
            parts = infinity.accumulate(
                model, xms, lambda out, xm: torch.nn.functional.mse_loss(out, target[id(xm)]),
                optimizer=opt if whole else None,
                max_grad_norm=opts.get("clip") if whole else None)
            loss = sum(p / len(xms) for p in parts)
        else:
            for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
                part = torch.nn.functional.mse_loss(model(xm), ym) / micro
                part.backward()
                loss = loss + part.detach()
        norm = None  # the gradients' norm before clipping
        if opts.get("layer_major") and opts.get("in_backward"):
            norm = infinity.stats(model)["accumulate"]["grad_norm"]
        else:
            if opts.get("clip"):
                norm = float(opt.clip_grad_norm_(opts["clip"]))
            opt.step()
            opt.zero_grad()
        result_steps.append(dict(infinity.stats(model)["nvme_per_step"]["bytes"], norm=norm,
                                 overlapped=getattr(opt.last_step_stats, "overlapped_shards", 0)))
        if sched is not None:
            sched.step()
        losses.append(_mean_loss(loss, world))
    if opts.get("save_to"):
        from infinity.sharding import full_optimizer_state_dict, full_state_dict
        saved = {"model": full_state_dict(model), "optim": full_optimizer_state_dict(opt)}
        if rank == 0:
            torch.save(saved, opts["save_to"])
    if rank in opts.get("fail_save_ranks", []):  # this rank's file write fails / is killed
        import errno

        import infinity.checkpoint.sharded as sharded_ckpt

        def broken(obj, path, how=opts.get("fail_save_how", "raise")):
            with open(path, "wb") as fh:
                fh.write(b"partial")
            if how == "kill":
                os._exit(9)
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        sharded_ckpt._write_durably = broken
    draw_after_save = None
    if opts.get("save_sharded_to"):
        # infinity.save_checkpoint of a sharded model: infinity.sharding.save_sharded
        if opts.get("sched") or opts.get("rng"):
            infinity.save_checkpoint(opts["save_sharded_to"], model, opt, scheduler=sched,
                                     rng=bool(opts.get("rng")), note=f"saved by {world}")
            if opts.get("rng"):
                draw_after_save = float(torch.rand(1))
        else:
            infinity.save_checkpoint(opts["save_sharded_to"], model, opt)
    result: Dict[str, Any] = {
        "losses": losses,
        "tiers": engine.tier_bytes(),
        "state_bytes": opt.state_bytes,
        "stats": infinity.stats(model),
        "partition": engine.partitioner.stats() if engine.partitioner is not None else None,
        "swap_dirs": sorted(os.listdir(out)) if nvme else [],
        "rss_growth_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0,
        "loaded_extra": loaded_extra, "draw_after_save": draw_after_save,
        "sched_last_epoch": sched.last_epoch if sched is not None else None,
        "lr": opt.param_groups[0]["lr"],
        "steps": result_steps,
    }
    if opts.get("legacy_to"):  # one process: the earlier per-rank format, as 1 rank wrote it
        _write_legacy(opts["legacy_to"], engine, opt)
    if opts.get("probe"):  # what ordinary PyTorch code sees on a sharded model
        result["state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            torch.optim.SGD(model.parameters(), lr=0.1).step()
            result["torch_optimizer"] = "no error"
        except RuntimeError as exc:
            result["torch_optimizer"] = str(exc)
    infinity.unwrap(model)  # sharded: every rank gets the whole parameters (all-gather)
    result["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return result


def _write_legacy(path: str, engine: Any, opt: Any) -> None:
    """A checkpoint in the per-rank format infinity wrote before the one format
    (``rank0-of-1.pt`` + a manifest with the flats' layout), from a single-process model."""
    import torch
    os.makedirs(path)
    flats = {}
    shards = {s.key: s for s in opt.state_dicts.shard_states()}
    for flat in engine.flats:
        entry = {"start": 0, "end": flat.numel, "home": engine.home.snapshot(flat).clone()}
        st = shards.get(flat.key)
        if st is not None and st.exp_avg is not None:
            entry.update(master=st.master.clone(), exp_avg=st.exp_avg.clone(),
                         exp_avg_sq=st.exp_avg_sq.clone(),
                         steps={i: st.steps[i] for i in range(len(flat.slots))
                                if st.steps[i] > 0})
        flats[flat.key] = entry
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    torch.save({"flats": flats, "param_groups": groups}, os.path.join(path, "rank0-of-1.pt"))
    layout = {f.key: {"used": f.used_numel, "dtype": str(f.home_dtype),
                      "slots": [[s.qualname, s.offset, s.numel] for s in f.slots]}
              for f in engine.flats}
    with open(os.path.join(path, "manifest.json"), "w") as fh:
        json.dump({"format": "infinity-zero-sharded", "version": 1, "world": 1,
                   "files": ["rank0-of-1.pt"], "layout": layout, "optimizer": True}, fh)


def _scenario_save_full(rank: int, world: int, out: Path, opts: Dict[str, Any]
                        ) -> Dict[str, Any]:
    """Trains 3 steps, then: the whole state dict on rank 0 (saved to opts["file"]), a
    forward on a fixed input, and what the unsupported sharded checkpoints say."""
    import torch

    import infinity
    from infinity.sharding import full_state_dict
    torch.manual_seed(0)
    model = _model()
    infinity.wrap(model)
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2)
    per = 4 // world
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        y = torch.randn(4, 4, generator=torch.Generator().manual_seed(100 + step))
        torch.nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]),
                                     y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
    result: Dict[str, Any] = {}
    sd = full_state_dict(model)
    if rank == 0:
        torch.save(sd, opts["file"])
    result["keys"] = sorted(sd)
    with torch.no_grad():
        result["output"] = model(torch.ones(2, 8)).clone()
    for what, fn in (("save_checkpoint", lambda: infinity.save_checkpoint(str(out / "ck"),
                                                                          model, opt)),
                     ("optimizer.state_dict", opt.state_dict)):
        try:
            fn()
            result[what] = "no error"
        except RuntimeError as exc:
            result[what] = str(exc)
    return result


def _scenario_load_full(rank: int, world: int, out: Path, opts: Dict[str, Any]
                        ) -> Dict[str, Any]:
    """A fresh model (other seed) loads the whole state dict on ``world`` ranks, trains one
    step from there with a fresh optimizer, and reports its forward outputs."""
    import torch

    import infinity
    from infinity.sharding import load_full_state_dict
    torch.manual_seed(123)
    model = _model()
    infinity.wrap(model)
    load_full_state_dict(model, torch.load(opts["file"]))
    with torch.no_grad():
        loaded = model(torch.ones(2, 8)).clone()
    opt = infinity.optim.AdamW(model.parameters(), lr=1e-2)
    per = 12 // world
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(7))
    y = torch.randn(12, 4, generator=torch.Generator().manual_seed(8))
    torch.nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]),
                                 y[rank * per:(rank + 1) * per]).backward()
    opt.step()
    with torch.no_grad():
        after = model(torch.ones(2, 8)).clone()
    return {"loaded": loaded, "after": after}


def _scenario_resume_many(rank: int, world: int, out: Path, opts: Dict[str, Any]
                          ) -> Dict[str, Any]:
    """In one process group: for each ``opts["loads"]`` entry ({"from": checkpoint, "nvme":
    bool}) a fresh model (other seed) is wrapped (everything on NVMe, or on host), loads the
    checkpoint with its optimizer and trains steps [start, stop) on the global batch split
    over the ranks; its losses and final whole parameters are reported per entry."""
    import torch

    import infinity
    steps, batch = opts["steps"], opts["batch"]
    xs = torch.randn(steps, batch, 8, generator=torch.Generator().manual_seed(1))
    ys = torch.randn(steps, batch, 4, generator=torch.Generator().manual_seed(2))
    per = batch // world
    runs = []
    for k, load in enumerate(opts["loads"]):
        torch.manual_seed(100 + k)
        model = _model()
        settings: Dict[str, Any] = dict(opts.get("settings", {}))
        if load.get("nvme"):
            (out / f"swap{k}").mkdir(exist_ok=True)
            settings.update(nvme_path=str(out / f"swap{k}"), param_tier="nvme",
                            grad_tier="nvme", optimizer_tier="nvme")
        else:
            settings.update(param_tier="host", optimizer_tier="host")
        infinity.wrap(model, **settings)
        opt = infinity.optim.AdamW(model.parameters(), lr=opts.get("lr", 1e-2),
                                   weight_decay=0.01, **opts.get("optim", {}))
        infinity.load_checkpoint(load["from"], model, opt)
        losses = []
        for step in range(opts["start"], opts["stop"]):
            x = xs[step, rank * per:(rank + 1) * per]
            y = ys[step, rank * per:(rank + 1) * per]
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if opts.get("clip"):
                opt.clip_grad_norm_(opts["clip"])
            opt.step()
            opt.zero_grad()
            losses.append(_mean_loss(loss, world))
        infinity.unwrap(model)
        runs.append({"losses": losses,
                     "params": {n: v.detach().clone() for n, v in model.state_dict().items()}})
        del opt
    return {"runs": runs}


def _scenario_dcp_load(rank: int, world: int, out: Path, opts: Dict[str, Any]
                       ) -> Dict[str, Any]:
    """A plain model on every rank filled by torch.distributed.checkpoint.load (collective)
    from the infinity checkpoint opts["from"]."""
    import torch
    import torch.distributed.checkpoint as dcp

    import infinity
    torch.manual_seed(99)
    model = _model()
    sd = model.state_dict()
    dcp.load(sd, storage_reader=infinity.checkpoint.dcp_reader(opts["from"]))
    return {"params": {k: v.clone() for k, v in sd.items()}}


def _scenario_fsdp2_save(rank: int, world: int, out: Path, opts: Dict[str, Any]
                         ) -> Dict[str, Any]:
    """A model sharded by FSDP2 (fully_shard per layer and at the root, CPU, gloo) trains 2
    steps and is saved by torch.distributed.checkpoint.save; its whole weights are returned."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = _model()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        torch.nn.functional.mse_loss(model(x[rank * 3:(rank + 1) * 3]),
                                     torch.zeros(3, 4)).backward()
        opt.step()
        opt.zero_grad()
    sd = model.state_dict()
    dcp.save({"model": sd}, checkpoint_id=opts["to"])
    return {"params": {k: v.full_tensor().clone() for k, v in sd.items()}}


def _scenario_dcp_into_wrapped(rank: int, world: int, out: Path, opts: Dict[str, Any]
                               ) -> Dict[str, Any]:
    """A wrapped (sharded on ranks) model loads the DCP checkpoint opts["from"]."""
    import torch

    import infinity
    torch.manual_seed(99)
    model = infinity.wrap(_model(), param_tier="host")
    infinity.checkpoint.load_dcp(opts["from"], model, prefix=opts.get("prefix", ""))
    infinity.unwrap(model)
    return {"params": {k: v.clone() for k, v in model.state_dict().items()}}


def _moe_model(kind: str, experts: int = 8):
    """A custom MoE with per-expert modules (as in transformers 4.x's Mixtral: top-2, an
    expert with no tokens is skipped), or a tiny Qwen3-MoE (fused 3-D experts)."""
    import torch
    from torch import nn
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        torch.manual_seed(0)
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=200, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=experts,
            num_experts_per_tok=2, head_dim=8, use_cache=False, output_router_logits=False))

    class Expert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(32, 64)
            self.down = nn.Linear(64, 32)

        def forward(self, x):
            return self.down(torch.nn.functional.silu(self.up(x)))

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(32, 8)
            self.experts = nn.ModuleList(Expert() for _ in range(8))
            self.used: set = set()  # experts that got tokens (reported)

        def forward(self, h):
            flat = h.reshape(-1, 32)
            probs = torch.softmax(self.router(flat), dim=-1)
            weights, chosen = probs.topk(2, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
            out = torch.zeros_like(flat)
            for e, expert in enumerate(self.experts):
                rows, which = (chosen == e).nonzero(as_tuple=True)
                if rows.numel() == 0:
                    continue  # no tokens: the expert does not run (no gradient)
                self.used.add(e)
                out = out.index_add(0, rows, expert(flat[rows]) * weights[rows, which, None])
            return h + out.reshape(h.shape)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(200, 32)
            self.layers = nn.ModuleList(MoE() for _ in range(2))
            self.head = nn.Linear(32, 200)
            self.recompute = False  # activation checkpointing of each layer

        def forward(self, input_ids, labels):
            h = self.embed(input_ids)
            for layer in self.layers:
                if self.recompute:
                    h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=self.recompute == "reentrant")
                else:
                    h = layer(h)
            logits = self.head(h)
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 200), labels.reshape(-1))

    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():  # expert 7 is never chosen by anyone: its gradient stays None
        for layer in net.layers:
            layer.router.bias[7] = -1e4 if layer is net.layers[0] else 0.0
    return net


def _scenario_moe(rank: int, world: int, out: Path, opts: Dict[str, Any]) -> Dict[str, Any]:
    """An MoE trained ``steps`` steps under ZeRO-3, the global batch (``seqs`` sequences of 5
    tokens, two batches alternating) split over the ranks, everything on NVMe; each rank's
    tokens come from its own half of the vocabulary, so the ranks route to different
    experts."""
    import torch

    import infinity
    kind = opts.get("kind", "custom")
    model = _moe_model(kind, opts.get("experts", 8))
    if opts.get("recompute"):
        model.recompute = opts["recompute"]
    settings: Dict[str, Any] = dict(opts.get("settings", {}))
    if opts.get("sliced"):  # fused experts sliced, each expert a block of its own
        infinity.slice_experts(model)
        settings["block_rule"] = infinity.expert_block_rule(model)
    steps, seqs = opts.get("steps", 20), opts.get("seqs", 4)
    g = torch.Generator().manual_seed(5)
    ranks_data = max(world, opts.get("data_ranks", 2))
    per = seqs // ranks_data
    # sequences of rank r draw from vocabulary [r * 200 / R, (r + 1) * 200 / R)
    width = 200 // ranks_data
    # two batches, alternating: a model that learns them lowers its loss
    data = torch.stack([torch.randint(r * width, (r + 1) * width, (2, per, 5), generator=g)
                        for r in range(ranks_data)], dim=1)  # 2 x ranks x per x 5
    if world > 1:
        settings.setdefault("shard", "zero3")
    settings.update(nvme_path=str(out), param_tier="nvme", grad_tier="nvme",
                    optimizer_tier="nvme")
    infinity.wrap(model, **settings)
    ran: list = []  # sliced: (expert's qualified name, tokens) per expert call this step
    if opts.get("sliced"):
        from infinity.runtime.experts import ExpertSlice, attach_agreement
        for qual, mod in model.named_modules():
            if isinstance(mod, ExpertSlice):
                mod.register_forward_hook(
                    lambda m, args, out, q=qual: ran.append((q, int(args[0].shape[0]))))
        if opts.get("no_agree"):
            attach_agreement(model, None)  # each rank runs its own experts only
    opt = infinity.optim.AdamW(model.parameters(), lr=opts.get("lr", 1e-3), weight_decay=0.01)
    losses, used = [], []
    for step in range(steps):
        ids = data[step % 2].reshape(-1, 5) if world == 1 else data[step % 2, rank]
        loss = model(input_ids=ids, labels=ids) if kind == "custom" else \
            model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_mean_loss(loss, world))
        if opts.get("sliced"):
            used.append(sorted(set(ran)))
            ran.clear()
        if kind == "custom":
            used.append([sorted(layer.used) for layer in model.layers])
            for layer in model.layers:
                layer.used = set()
    result: Dict[str, Any] = {"losses": losses, "used": used,
                              "partition": infinity.stats(model).get("zero"),
                              "blocks": infinity.stats(model)["blocks"]}
    infinity.unwrap(model)
    if opts.get("sliced"):
        infinity.fuse_experts(model)  # the parameters under their fused names
    result["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return result


SCENARIOS = {"train": _scenario_train, "dcp_load": _scenario_dcp_load,
             "dcp_into_wrapped": _scenario_dcp_into_wrapped,
             "fsdp2_save": _scenario_fsdp2_save, "resume_many": _scenario_resume_many, "save_full": _scenario_save_full,
             "load_full": _scenario_load_full,
             "moe": _scenario_moe}


def _main() -> None:
    import torch
    scenario, out, opts, use_dist = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), \
        sys.argv[4] == "1"
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if use_dist and world > 1:
        import datetime

        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=opts.get("pg_timeout", 60)))
    try:
        result = SCENARIOS[scenario](rank, world, out, opts)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    torch.save(result, out / f"rank{rank}.pt")
    sys.stdout.flush()
    if use_dist and world > 1:
        _leave_together(rank, world)
    os._exit(0)  # no teardown hang when a peer died


def _leave_together(rank: int, world: int, wait_s: float = 10.0) -> None:
    """Rank 0 hosts the store the others still use (creating a mesh's groups, for one): it
    leaves when every rank has left, or after ``wait_s`` when a peer is stuck or dead."""
    import time

    import torch.distributed as dist
    try:
        store = dist.distributed_c10d._get_default_store()
        store.add("tests_left", 1)
        deadline = time.monotonic() + wait_s
        while rank == 0 and store.add("tests_left", 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - a peer's store is gone: nothing to wait for
        pass


if __name__ == "__main__":
    _main()
