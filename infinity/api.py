"""The public entry points: wrap, unwrap, stats, materialized, gradient."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import weakref
from typing import Any, Dict, Iterator, Optional, Union

import torch
from torch import nn

from .policy import OffloadPolicy
from .runtime.build.dtypes import CPU_RATES, Rates, describe, summary
from .runtime.engine import Engine, engine_of, locate
from .runtime.experts import attach_agreement
from .runtime.homes.sources import CheckpointSource, Init, InitSource
from .runtime.process.host_memory import HOST_MEMORY, RELEASE
from .runtime.process.rss_bound import RssBound, read_memory


def _limit_activations(engine: Engine) -> None:
    """activation_tier="auto": each forward keeps in RAM the saved activations that fit the
    host budget's bound, and offloads the rest to NVMe. What the engine may still take of its
    budget: all of it until the first backward has run, then as much as it ever held beyond
    what it holds now."""
    acts, bound, host = engine.activations, engine.step.rss_bound, engine.host_budget
    if acts is None or not acts.auto or bound is None or host.limit is None:
        return
    limit = host.limit

    def headroom() -> int:
        growth = limit - host.used if bound.pending else host.high_water - host.used
        return bound.headroom(max(0, growth), acts.prefetch_bytes)

    acts.limit_by(headroom)


def wrap(
    model: nn.Module,
    nvme_path: Optional[str] = None,
    *,
    policy: Optional[OffloadPolicy] = None,
    source: Optional[Union[str, os.PathLike]] = None,
    init: Optional[Init] = None,
    process_group: Any = None,
    **settings: Any,
) -> nn.Module:
    """Returns ``model`` itself with its parameters moved to their offload tier.

    Settings are the fields of :class:`OffloadPolicy` (param_tier, grad_tier, optimizer_tier,
    device_budget, host_budget, prefetch_window, block_rule, compute_dtype, device,
    require_direct_io, verify_checksums, activation_tier, activation_min_bytes,
    activation_prefetch_bytes), given as keywords or as a ready ``policy``.

    A model built on the meta device (``with infinity.empty_init(): model = ...``) is filled one
    block at a time, never whole in RAM, from ``source`` (a ``.safetensors`` file, a sharded
    ``*.safetensors.index.json`` or a Hugging Face model folder; converted to the model's
    dtypes) or by ``init`` (``"reset_parameters"`` or a function ``init(module)``, run module by
    module in ``named_modules()`` order under the current RNG state).

    ``process_group``: shard over this ProcessGroup or DeviceMesh (2-D: replicate x shard)
    instead of the default group; see the ``shard`` setting and docs/zero3.md.

    With a ``host_budget`` on a CPU device, peak RSS should stay within RSS at this call +
    host_budget + 0.5 GiB; the engine bounds its own buffers, not the model's activations, so
    after the first backward the peak is checked once: over the bound, a warning names the
    figures and the remedies (``infinity.stats(model)["rss_check"]``).
    """
    memory_at_wrap = read_memory()  # the base of the host budget's promise
    if source is not None and init is not None:
        raise TypeError("pass either source= (a checkpoint) or init=, not both")
    if policy is not None:
        if settings or nvme_path is not None:
            raise TypeError("pass either policy=OffloadPolicy(...) or keyword settings, not both")
    else:
        unknown = sorted(set(settings) - set(OffloadPolicy.field_names()))
        if unknown:
            raise TypeError(
                f"unknown infinity.wrap setting(s) {unknown}; valid settings are "
                f"{list(OffloadPolicy.field_names())}"
            )
        policy = OffloadPolicy(nvme_path=nvme_path, **settings)
    from .plan.planner import apply_plan

    policy, plan, unplanned = apply_plan(model, policy, process_group)
    values = None
    if source is not None:
        values = CheckpointSource(source)
    elif init is not None:
        values = InitSource(init)
    try:
        engine = Engine(model, policy, values, process_group)
        # the promise checked after the first backward (None: no host_budget, or not a CPU)
        engine.step.rss_bound = RssBound.watch(
            engine.host_budget.limit, engine.device.type, memory_at_wrap
        )
        _limit_activations(engine)
        _agree_on_experts(model, engine)
        if plan is not None:  # explain(model) tells the compute dtype too
            plan = dataclasses.replace(
                plan, reasons=plan.reasons + (describe(engine.compute_dtypes),)
            )
        engine.plan, engine.unplanned = plan, unplanned
    finally:
        if values is not None:
            values.close()
    return model


@contextlib.contextmanager
def empty_init() -> Iterator[None]:
    """Builds models with their parameters on the meta device and their buffers real, for
    ``infinity.wrap(model, source=...)``::

        with infinity.empty_init():
            model = LlamaForCausalLM(config)
        infinity.wrap(model, nvme_path="/mnt/ssd", source="/models/llama")

    Each parameter is created by its module as usual and replaced by a meta tensor as it is
    registered, so no more than one parameter's memory exists at a time. Inside, glibc's mmap
    threshold is 128 KiB (see ``runtime/process/host_memory.py``) so those short-lived parameters do
    not leave holes in the heap that later raise peak RSS; on leaving, what the other users of
    glibc's thresholds want comes back (the heap-reusing threshold after a wrap without a
    host_budget), or glibc's defaults if there are none (``runtime/process/host_memory.py``).
    """
    lease = HOST_MEMORY.acquire(RELEASE, name="empty_init")
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original
        lease.release()


def probe_cache_rates(dtype: torch.dtype) -> Optional[Rates]:
    """This CPU's fp32 and bf16 rates from the probe's cache (``infinity.probe``), for the
    "auto" compute dtype (runtime/build/dtypes.py): the rates of its GPT layer at the widest
    width measured in both, when the cache holds a full probe of this machine computed on
    its CPU. None otherwise, and then wrap's quick check decides: a quick probe times two
    small layers twice with every thread, which on a loaded machine can put fp32 below bf16
    on a CPU that runs bf16 tens of times slower; the probe measures no fp16 rate."""
    if dtype != torch.bfloat16:
        return None
    from .plan.machine import key_of, machine_identity
    from .plan.probe import CACHE_VERSION, ProbeResult, cache_path

    path = cache_path()
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return None
    machine = data.get("machine")
    if not isinstance(machine, dict) or machine.get("quick", True):
        return None
    if machine.get("device") != "cpu" or data.get("identity_key") != key_of(machine_identity()):
        return None
    try:
        result = ProbeResult.from_json({**machine, "identity": data.get("identity", {})})
        widths = sorted(set(result.flops) & set(result.flops_bf16), key=int)
        if not widths:
            return None
        width = int(widths[-1])
        return Rates(
            result.flops_at(width),
            result.flops_at(width, torch.bfloat16),
            f"the probe cache {path}: a GPT layer of width {width}",
        )
    except (TypeError, ValueError, KeyError):
        return None


CPU_RATES.add_reader(probe_cache_rates)


def _agree_on_experts(model: nn.Module, engine: Engine) -> None:
    """Sliced MoE experts (infinity.slice_experts) under ZeRO with several ranks run the
    experts any rank routes to, so every rank issues the same collectives."""
    part = engine.partitioner
    if part is None or part.world * part.groups.replicas <= 1:
        attach_agreement(model, None)
        return
    ref = weakref.ref(engine)

    def agree(flags: torch.Tensor) -> torch.Tensor:
        live = ref()
        if live is None or live.partitioner is None or engine_of(model) is not live:
            return flags  # unwrapped: this process alone
        return live.partitioner.any_rank(flags)

    attach_agreement(model, agree)


def _engine(model: nn.Module) -> Engine:
    engine = engine_of(model)
    if engine is None:
        raise ValueError("this model is not wrapped by infinity; call infinity.wrap(model) first")
    return engine


def unwrap(model: nn.Module) -> nn.Module:
    """Removes the engine: the model gets plain parameters holding their current values."""
    _engine(model).close(restore=True)
    return model


def _swap_bytes(engine: Any) -> Dict[str, Any]:
    """Swap bytes by category: ``parameters`` (homes on NVMe), ``gradients`` (gradient files
    on NVMe that hold their disk: a file takes it at its first write), and the NVMe optimizer
    states' ``master``, ``moments`` and ``spare`` (beyond the committed states: extents in
    flight or kept for an update not yet confirmed); ``disk``
    the state files' blocks on the filesystem, ``peak`` their most live bytes so far;
    ``per_param`` each divided by the model's parameters."""
    from .optim.adam import swap_bytes_of

    homes = engine.tier_bytes()["nvme"]["params"]
    grads = engine.grads.file_bytes()  # files written at least once (they take disk then)
    states = swap_bytes_of(engine)
    out: Dict[str, Any] = {
        "parameters": homes,
        "gradients": grads,
        "master": states.get("master", 0),
        "moments": states.get("moments", 0),
        "spare": states.get("spare", 0),
        "states_disk": states.get("disk", 0),
        "states_peak": states.get("peak", 0),
    }
    n = max(1, sum(f.numel for f in engine.flats))
    out["per_param"] = {k: v / n for k, v in out.items()}
    return out


def stats(model: nn.Module, *, reset: bool = False) -> Dict[str, Any]:
    """Bytes per tier (now and peak), bytes moved per direction, prefetch hits and misses,
    seconds stalled waiting for data. ``time``: seconds spent since the last reset in compute
    (forward+backward outside the engine's hooks), ``fetch_wait``, ``grad_offload``, ``engine``
    (the rest of the hooks), ``transfer_cpu`` (transfer threads' CPU time) and the optimizer
    (``cpu_adam``, ``nvme_wait``, ``nvme_busy``, ``total``); ``nvme_bytes_written``: bytes written
    to NVMe in the last optimizer step and in all steps (SSD wear); ``nvme_per_step``: the last
    optimizer step's NVMe bytes by category (``params_read``, ``params_written``,
    ``grads_read``, ``grads_written``, ``states_read``, ``states_written``,
    ``activations_read``, ``activations_written``; each period ends at an optimizer step, so
    the forward and backward before a step count in it), the same per parameter of the
    model, and ``tb_written_per_1000_steps`` (SSD wear). ``reset=True`` starts a new
    measurement period. ``optimizer_states`` (when an ``infinity.optim`` optimizer steps the
    model): per moment format ("fp32"/"bf16"/"8bit") the number of parameters, their elements
    and their moments' bytes (``{"params", "numel", "moment_bytes"}``). ``fetched``: bytes
    fetched into compute buffers in their stored format, by category
    ``"<frozen|trainable|mixed>.<layer|outer|root>.<nf4|int8|dtype>"`` (with frozen_format,
    ``frozen.layer.nf4`` is the quantized base). ``swap``: the swap bytes by category and per
    parameter (parameters, gradients, master, moments, spare). ``compute_dtype``: the
    setting, each stored dtype's compute dtype (``chosen``: ``{"bfloat16": "float32"}``) and
    why (``why``; "auto" says the rates it compared). ``tiled_head``: the setting, whether
    the LM head is tiled (``on``) and why (``why``: with "auto", the bytes compared).
    ``rss_check`` (with a host_budget on a CPU device, once the first backward ended): the
    host budget's promise checked then: ``peak`` (VmHWM), ``bound`` (``rss_at_wrap`` +
    ``host_budget`` + ``slack``, 0.5 GiB), ``over``, ``peak_before_wrap`` and
    ``forward_growth`` (RSS growth across the forward before it: about the activations)."""
    engine = _engine(model)
    s = engine.stats
    out = {
        "param_tier": engine.param_tier.value,
        "compute_dtype": summary(engine.policy.compute_dtype, engine.compute_dtypes),
        "tiled_head": engine.head_choice.summary(),
        "param_blocks": {t.value: n for t, n in engine.param_blocks().items()},
        "tiers": engine.tier_bytes(),
        "moved": dict(s.moved),
        "fetched": dict(s.fetched),
        "prefetch_hits": s.prefetch_hits,
        "prefetch_misses": s.prefetch_misses,
        "prefetch_hit_rate": s.hit_rate,
        "on_demand_fetches": s.on_demand_fetches,
        "stall_seconds": s.stall_seconds,
        "fetches": s.fetches,
        "releases": s.releases,
        "schedule_deviations": s.schedule_deviations,
        "blocks": len(engine.blocks),
        "time": s.time_breakdown(),
        "nvme_bytes_written": {
            "last_step": s.nvme_written_last_step,
            "total": s.nvme_written_total,
        },
        "nvme_per_step": _nvme_per_step(engine),
    }
    from .optim.adam import state_formats_of

    formats = state_formats_of(engine)
    if formats:  # infinity optimizers' moment formats: {fmt: {params, numel, moment_bytes}}
        out["optimizer_states"] = formats
    out["swap"] = _swap_bytes(engine)
    if engine.partitioner is not None:  # ZeRO: stage, rank, collective calls/bytes/seconds
        out["zero"] = engine.partitioner.stats()
        if reset:
            engine.partitioner.coll.reset_counters()
    if engine.activations is not None:
        out["activations"] = engine.activations.report(reset=reset)
    if engine.step.rss_bound is not None and engine.step.rss_bound.result is not None:
        out["rss_check"] = dict(engine.step.rss_bound.result)  # the host budget's promise
    if s.micro_batches:
        out["accumulate"] = {
            "micro_batches": s.micro_batches,
            "tokens": s.tokens,
            "boundary_bytes_peak": s.boundary_bytes_peak,
            "grad_norm": s.grad_norm,
            "forward_s": s.forward_s,
            "backward_s": s.backward_s,
        }
    if reset:
        s.reset()
        engine.device_budget.reset_peak()
        engine.host_budget.reset_peak()
    return out


def _nvme_per_step(engine) -> Dict[str, Any]:
    """NVMe bytes of the last optimizer step by category (``<what>_read``/``<what>_written``
    for params, grads, states, activations), the same per parameter of the model, and the
    SSD wear that step's writes mean: terabytes written per 1,000 such steps."""
    s = engine.stats
    params = sum(f.numel for f in engine.flats) or 1
    last = dict(s.nvme_by_category_last_step)
    out: Dict[str, Any] = {
        "bytes": last,
        "bytes_per_param": {k: v / params for k, v in last.items()},
        "written": s.nvme_written_last_step,
        "tb_written_per_1000_steps": s.nvme_written_last_step * 1000 / 1e12,
    }
    if s.tokens_last_step:  # a layer-major step counted its tokens (infinity.accumulate)
        tokens = s.tokens_last_step
        moved = sum(v for k, v in last.items() if not k.startswith("activations"))
        out["tokens"] = tokens
        out["bytes_per_token"] = moved / tokens
        out["activation_bytes_per_token"] = (
            last["activations_read"] + last["activations_written"]
        ) / tokens
    return out


@contextlib.contextmanager
def materialized(model: nn.Module, module: Optional[nn.Module] = None) -> Iterator[None]:
    """Within the block, the parameters of ``module`` (a submodule of the wrapped model; all
    of them when None) are materialized and can be read outside forward."""
    with _engine(model).materialized(module):
        yield


def parameters_changed(model: nn.Module) -> None:
    """Call after changing a wrapped model's parameters in place through ``p.data`` outside
    forward (``p.data += delta``, as PEFT's merge does): such writes do not bump the
    parameter's version counter, so the engine cannot see them. Writes through the parameter
    itself under ``torch.no_grad()`` (``p.add_(delta)``, ``load_state_dict``) need no call."""
    _engine(model).outside.assume_all_written()


def gradient(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient accumulated for ``param`` since the last zero_grad.

    For a wrapped parameter this is a view into its block's fp32 host gradient buffer (the
    engine frees ``param.grad`` on the device as soon as it is offloaded, so ``param.grad`` is
    None); for any other parameter it is ``param.grad``.
    """
    loc = locate(param)
    if loc is None:
        return param.grad
    if loc.engine.partitioner is not None and loc.engine.partitioner.shards_grads:
        raise RuntimeError(
            "infinity.gradient: with shard='zero2'/'zero3' each rank holds only "
            "its part of a gradient (reduce-scattered); there is no whole "
            "gradient to return. Use shard='zero1' to keep whole gradients"
        )
    loc.engine.sync_gradients()
    return loc.engine.grads.gradient(loc.flat, loc.slot)
