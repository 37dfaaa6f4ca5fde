"""User-facing policies: frozen dataclasses, one name and one default per setting, checked once."""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, fields
from typing import Callable, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .sizes import Size, parse_budget
from .tiers.chunk_size import check_chunk_bytes
from .tiers.tier import Tier

# the frozen formats a quantized home can store (runtime/homes/quant_format.py lays each out)
FROZEN_FORMATS = ("nf4", "nf4-dq", "int8")

BlockRule = Union[None, Sequence[type], Callable[[str, nn.Module], bool]]

_WORKING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def nvme_path_problem(
    path: Union[str, os.PathLike[str]], must_exist: bool = False
) -> Optional[Tuple[type, str]]:
    """Why ``path`` cannot be an nvme_path, as (exception class, message), or None. Checked
    before anything is written: an existing file (or other non-directory) is always wrong; a
    missing path only where ``must_exist`` (a policy may be made before its directory)."""
    if not isinstance(path, (str, os.PathLike)):
        return None  # the swap store names the type
    if os.path.isdir(path):
        return None
    if os.path.lexists(path):
        what = "a file" if os.path.isfile(path) else "not a directory"
        parent = os.path.dirname(os.path.abspath(path))
        return NotADirectoryError, (
            f"infinity: nvme_path {os.fspath(path)!r} is {what}, not a directory; pass a "
            f"directory on the fast disk instead (e.g. {parent!r}, or a new folder there): "
            "infinity creates its swap files inside it"
        )
    if must_exist:
        return FileNotFoundError, (
            f"infinity: nvme_path {os.fspath(path)!r} does not exist; create the directory (on "
            "the disk that will hold the swap files) first: infinity creates its swap files "
            "inside it"
        )
    return None


def check_nvme_path(path: Optional[Union[str, os.PathLike[str]]], must_exist: bool = False) -> None:
    """Raises what :func:`nvme_path_problem` finds (NotADirectoryError, FileNotFoundError)."""
    problem = None if path is None else nvme_path_problem(path, must_exist)
    if problem is not None:
        raise problem[0](problem[1])


@dataclass(frozen=True)
class CommPolicy:
    """Compressed collectives for ZeRO (``wrap(..., comm=...)``; docs/zero3.md).

    weights: "int8": ZeRO-3's all-gathers of parameters for compute carry int8 codes with one
        fp32 scale per ``block`` values (every rank computes with the same dequantized
        weights; the master weights and the homes stay exact). "none": full width.
    grads: "int8" or "int4": gradients are reduced through an all-to-all of block-quantized
        parts, dequantized and summed in fp32 (ZeRO-2/3). "none": a full-width reduce-scatter.
    error_feedback: each rank adds what its last quantization lost to its next gradient
        (an fp32 buffer of the whole model's size per rank, in host RAM).
    block: values per fp32 scale.
    node_size: a hierarchical partition (ZeRO++'s hpZ; 0: none): ranks in groups of this
        many consecutive ranks (a node). After a block's forward all-gather each rank keeps
        its node's share of it (the block's bytes / node_size, until its backward), so the
        backward's all-gathers stay inside the node.

    ``comm="int8"`` is weights and gradients in int8; ``comm="int4"`` is int8 weights and
    int4 gradients with error feedback."""

    weights: str = "none"
    grads: str = "none"
    error_feedback: bool = False
    block: int = 256
    node_size: int = 0

    def __post_init__(self) -> None:
        if self.weights not in ("none", "int8"):
            raise ValueError(f"infinity: comm weights={self.weights!r}; use 'int8' or 'none'")
        if self.grads not in ("none", "int8", "int4"):
            raise ValueError(f"infinity: comm grads={self.grads!r}; use 'int8', 'int4' or 'none'")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 32:
            raise ValueError(
                f"infinity: comm block={self.block!r}; use an even number of values >= 32"
            )
        if self.block % 2:
            raise ValueError(f"infinity: comm block={self.block} must be even")
        if isinstance(self.node_size, bool) or not isinstance(self.node_size, int):
            raise ValueError(f"infinity: comm node_size={self.node_size!r}; use an int")
        if self.node_size == 1 or self.node_size < 0:
            raise ValueError(
                f"infinity: comm node_size={self.node_size}; use 0 (no hierarchical "
                "partition) or the ranks per node (2 or more)"
            )

    @property
    def off(self) -> bool:
        return self.weights == "none" and self.grads == "none" and not self.node_size

    @classmethod
    def parse(cls, value: Union[None, str, CommPolicy]) -> CommPolicy:
        if isinstance(value, CommPolicy):
            return value
        if value is None or value == "none":
            return cls()
        if value == "int8":
            return cls("int8", "int8")
        if value == "int4":
            return cls("int8", "int4", error_feedback=True)
        raise ValueError(
            f"infinity: comm={value!r}; use None, 'int8', 'int4' or "
            "infinity.CommPolicy(weights=..., grads=..., error_feedback=...)"
        )


@dataclass(frozen=True)
class OffloadPolicy:
    """Where each kind of state lives and how much of each tier the engine may use.

    param_tier: "device" (no offload), "host", "nvme", or "auto": chosen by the planner (see
        ``placement``); with placement=None, nvme when nvme_path is given and the parameters
        do not fit in host_budget (or no host_budget is set), else host.
    host_blocks: with parameters on NVMe, the parameters of the first ``host_blocks`` blocks
        stay in host RAM instead (a per-block split: "the first blocks on host, the rest on
        NVMe"). Blocks count in the engine's order: the repeated layers in model order, then
        the outer blocks (embedding, head: see param_persistence_threshold), then the root
        block (the small parameters outside the layers). None or 0: every
        block on ``param_tier``. Needs param_tier "nvme" (or "auto" resolving to it).
    grad_tier: where the fp32 gradient accumulators live between backward and the optimizer
        step: "host", "nvme" (a few blocks' worth of host buffers, the rest in swap files), or
        "auto" (nvme when param_tier resolves to nvme, else host).
    optimizer_tier: the same choice for the optimizer's fp32 master weights and moments
        ("device" is not offered: the CPU Adam reads them from host or NVMe).
    device_budget / host_budget: byte limits (None: no limit beyond the hardware), as ints or
        strings such as "24GB", "6GiB", "512MiB" or "1.5 GiB" (see ``infinity.sizes``; read
        back as ints: the policy keeps the number of bytes). The device
        budget bounds the parameters materialized for compute; the host budget bounds pinned
        host buffers (home copies, gradients, staging, optimizer states on host).
    prefetch_window: how many blocks ahead of the running one may be fetched.
    block_rule: None (each child of an nn.ModuleList is a block), a sequence of module
        classes, or a predicate ``(qualified_name, module) -> bool``.
    device: where forward and backward compute: "cuda", "cuda:N" or "cpu" (None: CUDA when
        available, else the CPU).
    compute_dtype: the dtype parameters are materialized in for forward/backward. "auto" (the
        default): fp32 parameters compute in fp32; bf16 and fp16 parameters compute in their
        own dtype on CUDA and on a CPU that runs that dtype fast (AMX, AVX512-BF16/FP16), and
        in fp32 on a CPU that does not (AVX2: tens of times slower than fp32), decided from
        the probe's cached rates or a quick check of a few milliseconds at the first wrap
        (runtime/build/dtypes.py; ``infinity.stats(model)["compute_dtype"]`` and
        ``infinity.explain`` say which and why). Computing bf16 parameters in fp32 doubles
        their compute buffers (counted in the budgets). A dtype (torch.float32,
        torch.bfloat16, torch.float16): every parameter computes in it. None: every parameter
        computes in its own dtype, as FSDP2's MixedPrecisionPolicy without a param_dtype
        (what the default was before "auto").
    require_direct_io: refuse a filesystem without O_DIRECT instead of warning and using the
        page cache.
    verify_checksums: CRC32C every swap file write and check it on every read.
    shard: ZeRO sharding over torch.distributed ranks (see docs/zero3.md): "zero3"
        (parameters, gradients and optimizer states), "zero2" (gradients and states),
        "zero1" (states), "none", or "auto" (zero3 when torch.distributed is initialised
        with more than one rank or a process group / DeviceMesh is given, else none).
    collective_timeout: seconds a collective may wait for the other ranks before failing
        (ranks that diverged or died); applies to the group infinity makes from the default
        one (a group or mesh passed to wrap keeps its own timeout).
    comm: compressed collectives under ZeRO: None (full width), "int8", "int4" or a
        :class:`CommPolicy`; every rank must pass the same.
    placement: "auto" (the default): the planner (``infinity.plan``) picks the tiers left
        "auto" (per block where that helps: ``host_blocks``) and, when prefetch_window is left
        at its default, the window, from the budgets (device memory, a share of the available
        RAM, the free disk at nvme_path) and the probed machine (cached; a quick probe the
        first time); see ``infinity.explain(model)``. It is skipped, and the rules above
        resolve each "auto", when all three tiers are set explicitly or the model is sharded
        over several ranks. None: always the rules.
    activation_tier: where the tensors autograd saves for backward go during forward: None
        (they stay on the device, as in plain PyTorch), "host" (a pool of host buffers inside
        host_budget), "nvme" (scratch swap files under nvme_path) or "auto": on a CPU device
        with host_budget and nvme_path set, each forward keeps in RAM what fits the host
        budget's bound (RSS at wrap + host_budget + 0.5 GiB, less RSS when the forward starts,
        less what the engine may still take of its budget and the fetch window, halved for
        backward's own allocations) and offloads the rest to NVMe; elsewhere (CUDA, no
        budget, no nvme_path) as None. Not the default: its pack hook runs in every forward,
        and under torch.compile dynamo traces it. See docs/activation_offload.md.
    activation_min_bytes: only saved tensors of at least this many bytes are offloaded
        (None: 1 MiB). Needs activation_tier.
    activation_prefetch_bytes: the activation window: at most this many bytes of offloaded
        activations are fetched back ahead of their use in backward (up to ``prefetch_window``
        segments ahead), and forward waits while more than this many bytes of saved tensors
        are still being copied out (None: 256 MiB). Needs activation_tier.
    chunk_bytes: the size of every host buffer that swap-file I/O and the optimizer pass
        through (staging, gradient buffers, the optimizer's NVMe buffer sets): a flat of any
        size streams through them chunk by chunk. An int or a size string, a multiple of 4096
        (None: 1/32 of host_budget, at least 1 MiB and at most 256 MiB; 256 MiB without one).
        See ``infinity.tiers.chunk_size``.
    frozen_format: None (frozen parameters keep their dtype), "nf4" (bitsandbytes' NF4, blocks
        of 64: 0.5625 bytes per parameter), "nf4-dq" (NF4 with its absmax double-quantized
        as bitsandbytes' compress_statistics: 0.5161 bytes per parameter) or "int8" (symmetric block-wise int8, blocks of 256:
        1.0156 bytes per parameter). The frozen matrices (``requires_grad=False`` at wrap, two
        or more dimensions) of the layer blocks are quantized when their home is filled, stored
        in that format on host or NVMe, and dequantized into the compute buffer at each fetch.
        Trainable parameters, frozen vectors (norms, biases) and the blocks outside the layers
        (embeddings, LM head) keep their own dtype, as bitsandbytes' QLoRA does. See
        docs/frozen_formats.md.
    param_persistence_threshold: modules outside the layer list (embeddings, final norm, LM
        head) whose parameters hold at least this many elements are blocks of their own,
        fetched when they run and released after; smaller ones stay in the root block,
        materialized for the whole step (DeepSpeed's stage3_param_persistence_threshold).
        Each module is counted with the parameters it owns directly; modules sharing a
        parameter (a tied embedding and head) count together and make one block.
    embedding_rows: an ``nn.Embedding`` that is an outer block of its own (not tied to a
        head) on the host or NVMe tier reads only the rows its batch looks up (on NVMe the
        swap file's pieces that hold them), and its gradient is accumulated row-sparse into
        the gradient tier (zeros elsewhere): the table is never materialized whole and no
        full-size dense gradient exists. Numbers are those of the plain lookup.
        See infinity/runtime/vocab/rows.py. False: fetched whole when it runs.
    tiled_head: True: the LM head (``get_output_embeddings()``, tied or not) streams its weight
        from its home in tiles of vocabulary rows (about a chunk each) and is never
        materialized whole; in a forward with labels (a Hugging Face ``*ForCausalLM``) the loss
        is computed over the tiles with an online logsumexp, the logits are never materialized
        and the output's ``logits`` is None; without labels the logits are computed tile by
        tile. Within 1e-6 relative of plain PyTorch in fp32 (4e-6 over a large vocabulary).
        See infinity/runtime/vocab/tiled_head.py. False: the head is fetched whole.
        "auto" (the default): tiled where a budget is set that the head fetched whole would
        break -- its weight with its gradient (and, tied, the embedding's dense gradient) next
        to what the engine holds (the host budget on a CPU device, the device budget on
        CUDA) -- and the head can be tiled; whole otherwise (runtime/build/head.py;
        ``infinity.stats(model)["tiled_head"]`` says which and why).
    """

    param_tier: str = "auto"
    grad_tier: str = "auto"
    optimizer_tier: str = "auto"
    nvme_path: Optional[str] = None
    device_budget: Optional[Size] = None
    host_budget: Optional[Size] = None
    prefetch_window: int = 2
    block_rule: BlockRule = None
    compute_dtype: Union[str, torch.dtype, None] = "auto"
    device: Optional[Union[str, torch.device]] = None
    require_direct_io: bool = False
    verify_checksums: bool = True
    shard: str = "auto"
    collective_timeout: float = 600.0
    comm: Union[None, str, CommPolicy] = None
    placement: Optional[str] = "auto"
    activation_tier: Optional[str] = None
    activation_min_bytes: Optional[int] = None
    activation_prefetch_bytes: Optional[int] = None
    host_blocks: Optional[int] = None
    chunk_bytes: Optional[Size] = None
    param_persistence_threshold: int = 100_000
    frozen_format: Optional[str] = None
    embedding_rows: bool = True
    tiled_head: Union[bool, str] = "auto"

    def __post_init__(self) -> None:
        if self.param_tier != "auto":
            Tier.parse(self.param_tier, what="param_tier")
        if self.optimizer_tier not in ("auto", "host", "nvme"):
            raise ValueError(
                f"optimizer_tier={self.optimizer_tier!r}; use 'host', 'nvme' or 'auto'"
            )
        if self.grad_tier not in ("auto", "host", "nvme"):
            raise ValueError(f"grad_tier={self.grad_tier!r}; use 'host', 'nvme' or 'auto'")
        check_nvme_path(self.nvme_path)  # an existing file: refused before anything is written
        for name in ("param_tier", "grad_tier", "optimizer_tier"):
            if getattr(self, name) == "nvme" and self.nvme_path is None:
                raise ValueError(f"{name}='nvme' needs nvme_path=<a directory on a fast disk>")
        self._check_host_blocks()
        if self.placement not in (None, "auto"):
            raise ValueError(f"placement={self.placement!r}; use 'auto' (the planner) or None")
        for name in ("device_budget", "host_budget", "chunk_bytes"):
            value = getattr(self, name)
            if value is not None:  # frozen: normalised once, downstream code sees ints
                object.__setattr__(self, name, parse_budget(value, name))
        check_chunk_bytes(self.chunk_bytes, "infinity.wrap")
        if not isinstance(self.embedding_rows, bool):
            raise ValueError(
                f"infinity: embedding_rows must be True or False, got {self.embedding_rows!r}"
            )
        if not isinstance(self.tiled_head, bool) and self.tiled_head != "auto":
            raise ValueError(
                f"infinity: tiled_head must be True, False or 'auto', got {self.tiled_head!r}"
            )
        t = self.param_persistence_threshold
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ValueError(
                f"infinity: param_persistence_threshold must be an integer number "
                f"of elements >= 0, got {t!r}"
            )
        if (
            isinstance(self.prefetch_window, bool)
            or not isinstance(self.prefetch_window, numbers.Integral)
            or self.prefetch_window < 0
        ):
            raise ValueError(
                f"prefetch_window must be an integer >= 0, got {self.prefetch_window!r}"
            )
        cd = self.compute_dtype
        if (
            cd is not None
            and cd != "auto"
            and not (isinstance(cd, torch.dtype) and cd in _WORKING_DTYPES)
        ):
            raise ValueError(
                f"infinity: compute_dtype={cd!r} is not supported; use 'auto' (the default: "
                "chosen for the device), torch.float32, torch.bfloat16, torch.float16, or None "
                "(each parameter computes in its own dtype)"
            )
        if self.device is not None:
            try:
                dev = torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError(f"device={self.device!r} is not a device: {exc}") from None
            if dev.type not in ("cpu", "cuda"):
                raise ValueError(
                    f"device={self.device!r} is not supported; use 'cuda', 'cuda:N' or 'cpu'"
                )
        if self.shard not in ("auto", "none", "zero1", "zero2", "zero3"):
            raise ValueError(
                f"shard={self.shard!r}; use 'zero3', 'zero2', 'zero1', 'none' or 'auto'"
            )
        if (
            isinstance(self.collective_timeout, bool)
            or not isinstance(self.collective_timeout, numbers.Real)
            or not self.collective_timeout > 0
        ):
            raise ValueError(
                f"collective_timeout must be a positive number of seconds, got "
                f"{self.collective_timeout!r}"
            )
        CommPolicy.parse(self.comm)
        self._check_activations()
        if self.frozen_format is not None and self.frozen_format not in FROZEN_FORMATS:
            raise ValueError(
                f"infinity: frozen_format={self.frozen_format!r} is not supported; "
                "use 'nf4', 'nf4-dq', 'int8' or None"
            )
        if self.frozen_format is not None and self.param_tier == "device":
            raise ValueError(
                f"infinity: frozen_format={self.frozen_format!r} stores frozen "
                "parameters quantized on host or NVMe; param_tier='device' keeps "
                "them materialized. Use param_tier='host' or 'nvme'"
            )
        rule = self.block_rule
        if rule is not None and not callable(rule):
            if (
                not isinstance(rule, (list, tuple))
                or not rule
                or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in rule)
            ):
                raise TypeError(
                    "block_rule must be None, a sequence of nn.Module subclasses, "
                    f"or a callable (name, module) -> bool; got {rule!r}"
                )

    def _check_host_blocks(self) -> None:
        k = self.host_blocks
        if k is None:
            return
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(
                f"infinity: host_blocks must be an integer >= 0 (how many blocks "
                f"keep their parameters in host RAM) or None, got {k!r}"
            )
        if k and self.param_tier not in ("auto", "nvme"):
            raise ValueError(
                f"infinity: host_blocks={k} splits parameters between host and "
                f"NVMe; it needs param_tier='nvme' (or 'auto'), not "
                f"{self.param_tier!r}"
            )
        if k and self.nvme_path is None:
            raise ValueError(
                f"infinity: host_blocks={k} keeps the other blocks' parameters on "
                "NVMe: pass nvme_path=<a directory on a fast disk>"
            )

    def _check_activations(self) -> None:
        tier = self.activation_tier
        if tier is not None and tier not in ("host", "nvme", "auto"):
            hint = (
                " (activations already live on the device without offload: use None)"
                if tier == "device"
                else ""
            )
            raise ValueError(
                f"infinity: activation_tier={tier!r} is not supported; use None "
                f"(no activation offload), 'host', 'nvme' or 'auto'{hint}"
            )
        if tier == "nvme" and self.nvme_path is None:
            raise ValueError(
                "infinity: activation_tier='nvme' needs nvme_path=<a directory on "
                "a fast disk> for the activations' scratch swap files"
            )
        for name in ("activation_min_bytes", "activation_prefetch_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if tier is None:
                raise ValueError(
                    f"infinity: {name}={value!r} has no effect without "
                    "activation_tier; pass activation_tier='host' or 'nvme' too"
                )
            low = 0 if name == "activation_min_bytes" else 1
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ValueError(
                    f"infinity: {name} must be an integer number of bytes >= {low}, got {value!r}"
                )

    @classmethod
    def field_names(cls) -> tuple:
        return tuple(f.name for f in fields(cls))
