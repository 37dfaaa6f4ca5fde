"""Where the values of a model built on the meta device come from, one block at a time.

Design notes: docs/modules.md, runtime/homes/sources.py."""

from __future__ import annotations

import json
import logging
import os
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple, Union

import torch
from torch import nn

from . import source_quant
from .expert_keys import aliases, expert_keys

logger = logging.getLogger(__name__)

Owners = Dict[int, List[Tuple[nn.Module, str]]]


class SourceError(ValueError):
    """The source does not match the model or is not a readable checkpoint."""


def param_owners(model: nn.Module) -> Tuple[Owners, Dict[int, List[str]]]:
    """For every parameter (by id): the (module, attribute) pairs holding it and all its
    qualified names (a tied weight has several)."""
    owners: Owners = {}
    names: Dict[int, List[str]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            owners.setdefault(id(p), [])
            if not any(m is mod and a == attr for m, a in owners[id(p)]):
                owners[id(p)].append((mod, attr))
            qual = f"{mod_name}.{attr}" if mod_name else attr
            names.setdefault(id(p), [])
            if qual not in names[id(p)]:
                names[id(p)].append(qual)
    return owners, names


def replace_param(owners: Owners, old: nn.Parameter, value: torch.Tensor) -> nn.Parameter:
    """A new Parameter holding ``value`` takes ``old``'s place on every module sharing it."""
    new = nn.Parameter(value, requires_grad=old.requires_grad)
    for module, attr in owners.get(id(old), []):
        module._parameters[attr] = new
    owners[id(new)] = owners.pop(id(old), [])
    return new


class ParamSource:
    """Makes meta parameters real (CPU tensors), block by block."""

    def value(self, names: List[str], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def read_into(self, names: List[str], out: torch.Tensor) -> None:
        out.copy_(self.value(names, out.shape, out.dtype))

    def buffer_value(self, name: str) -> Optional[torch.Tensor]:
        return None

    def finish(self) -> None:
        """After every block: reports keys the model did not use."""

    def close(self) -> None:
        pass


# ---- checkpoints ----------------------------------------------------------------------------
def _checkpoint_files(path: str) -> List[str]:
    """The safetensors files of a checkpoint given as a file, an index or a folder."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"infinity.wrap(source={path!r}): no such file or folder")
    if os.path.isdir(path):
        for name in ("model.safetensors.index.json", "model.safetensors"):
            candidate = os.path.join(path, name)
            if os.path.exists(candidate):
                return _checkpoint_files(candidate)
        found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not found:
            raise SourceError(
                f"infinity.wrap(source={path!r}): the folder holds no "
                "model.safetensors, model.safetensors.index.json or *.safetensors "
                "file; save the model with save_pretrained(safe_serialization="
                "True) or safetensors.torch.save_file"
            )
        return [os.path.join(path, f) for f in found]
    if path.endswith(".json"):
        try:
            with open(path, "r", encoding="utf-8") as fh:
                index = json.load(fh)
            files = sorted(set(index["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SourceError(
                f"infinity.wrap(source={path!r}): not a safetensors index "
                f"(needs a 'weight_map'): {exc}"
            ) from None
        base = os.path.dirname(path)
        return [os.path.join(base, f) for f in files]
    if path.endswith(".safetensors"):
        return [path]
    raise SourceError(
        f"infinity.wrap(source={path!r}): expected a .safetensors file, a "
        "*.safetensors.index.json or a Hugging Face model folder"
    )


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsFile:
    """Reads tensors of one .safetensors file (the published format: an 8-byte little-endian
    header size, a JSON header of dtype/shape/data_offsets, then the data) with plain reads,
    one tensor at a time. No memory map: a mapped file's touched pages would count in the
    process's RSS until it is closed, which defeats loading a model larger than RAM."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(self._fd).st_size
            raw = os.pread(self._fd, 8, 0)
            if len(raw) != 8:
                raise SourceError(f"{path!r} is not a safetensors file (shorter than 8 bytes)")
            n = int.from_bytes(raw, "little")
            if n <= 0 or 8 + n > size:
                raise SourceError(
                    f"{path!r} is not a safetensors file (header size {n} does "
                    f"not fit in {size} bytes)"
                )
            try:
                header = json.loads(os.pread(self._fd, n, 8))
            except ValueError as exc:
                raise SourceError(f"{path!r}: unreadable safetensors header: {exc}") from None
        except BaseException:
            os.close(self._fd)
            raise
        header.pop("__metadata__", None)
        self._base = 8 + n
        self.entries: Dict[str, dict] = header
        self._size = size

    def keys(self) -> Iterable[str]:
        return self.entries.keys()

    def shape(self, key: str) -> Tuple[int, ...]:
        return tuple(self.entries[key]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        entry = self.entries[key]
        dtype = _ST_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise SourceError(
                f"{self.path!r}: tensor {key!r} has dtype {entry['dtype']}, "
                "which infinity does not load"
            )
        return dtype

    def get_tensor(self, key: str) -> torch.Tensor:
        out = torch.empty(self.shape(key), dtype=self.dtype(key))
        self.read_into(key, out)
        return out

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Reads tensor ``key`` into ``out`` (contiguous CPU, same dtype and numel), converting
        through a temporary when the dtypes differ."""
        entry = self.entries[key]
        dtype = self.dtype(key)
        if out.dtype != dtype:
            out.copy_(self.get_tensor(key).view(out.shape))
            return
        begin, end = entry["data_offsets"]
        nbytes = out.numel() * out.element_size()
        if end - begin != nbytes or self._base + end > self._size:
            raise SourceError(
                f"{self.path!r}: tensor {key!r} is truncated or its offsets do "
                "not match its shape; the checkpoint is damaged"
            )
        view = memoryview(out.view(-1).view(torch.uint8).numpy()) if nbytes else None
        done = 0
        while done < nbytes:
            got = os.preadv(self._fd, [view[done:]], self._base + begin + done)
            if got <= 0:
                raise SourceError(f"{self.path!r}: unexpected end of file reading {key!r}")
            done += got

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class CheckpointSource(ParamSource):
    def __init__(self, path: Union[str, os.PathLike]) -> None:
        self.path = os.fspath(path)
        self._handles: List[SafetensorsFile] = []
        self._where: Dict[str, SafetensorsFile] = {}
        try:
            for file in _checkpoint_files(self.path):
                handle = SafetensorsFile(file)
                self._handles.append(handle)
                for key in handle.keys():
                    self._where[key] = handle
            self._bnb4 = source_quant.scan(
                self.path, self._where, lambda k: self._where[k].get_tensor(k), SourceError
            )
        except BaseException:
            self.close()
            raise
        self._used: Set[str] = set()
        self._missing: List[str] = []
        self._mismatched: List[str] = []

    def _find(self, names: List[str]) -> Optional[str]:
        for name in names:
            if name in self._where:
                return name
        return None

    def read_into(self, names: List[str], out: torch.Tensor) -> None:
        """Reads the parameter known by ``names`` into ``out`` (its place in a block's arena;
        converted to ``out``'s dtype)."""
        keys = self._keys(names, out.shape)
        if len(keys) == 1 and keys[0] in self._bnb4:
            out.copy_(self._decode(keys[0]))
            return
        flat, done = out.view(-1), 0
        for key in keys:  # an MoE weight stored per expert: the pieces one after the other
            n = self._numel(key)
            self._where[key].read_into(key, flat[done : done + n])
            done += n

    def _numel(self, key: str) -> int:
        n = 1
        for d in self._where[key].shape(key):
            n *= d
        return n

    def _decode(self, key: str) -> torch.Tensor:
        """A bitsandbytes NF4 weight, decoded (runtime/homes/source_quant.py)."""
        weight = self._bnb4[key]
        self._used.update(k for k in source_quant.companions(weight) if k in self._where)
        try:
            return source_quant.decode(
                weight, lambda k: self._where[k].get_tensor(k), lambda k: k in self._where
            )
        except ValueError as exc:
            raise SourceError(f"infinity.wrap(source={self.path!r}): {exc}") from None

    def _keys(self, names: List[str], shape: torch.Size) -> List[str]:
        key = self._find(names) or self._find([a for n in names for a in aliases(n)])
        if key is None:
            pieces = self._expert_pieces(names, shape)
            if pieces is not None:
                return pieces
            raise SourceError(
                f"infinity.wrap: parameter {names[0]!r} is not in the checkpoint "
                f"{self.path!r}"
                + (f" (also looked for {names[1:]})" if len(names) > 1 else "")
                + "; check that the checkpoint belongs to this model"
            )
        handle = self._where[key]
        stored = self._bnb4[key].shape if key in self._bnb4 else handle.shape(key)
        if stored != tuple(shape):
            raise SourceError(
                f"infinity.wrap: checkpoint {self.path!r} holds {key!r} with shape "
                f"{stored} but the model's parameter has shape "
                f"{tuple(shape)}"
            )
        self._used.update(n for n in names if n in self._where)
        self._used.add(key)
        return [key]

    def _expert_pieces(self, names: List[str], shape: torch.Size) -> Optional[List[str]]:
        """An MoE experts weight the checkpoint holds per expert (runtime/homes/expert_keys.py):
        its keys, checked to add up to the parameter's shape."""
        for name in names:
            keys = expert_keys(name, shape[0] if len(shape) == 3 else None, self._has_plain)
            if keys is None:
                continue
            rows = sum(self._where[k].shape(k)[0] for k in keys)
            cols = {self._where[k].shape(k)[1:] for k in keys}
            want_rows = shape[0] * shape[1] if len(shape) == 3 else shape[0]
            if rows != want_rows or cols != {tuple(shape[-1:])}:
                raise SourceError(
                    f"infinity.wrap: checkpoint {self.path!r} holds {name!r} as {len(keys)} "
                    f"per-expert tensors ({keys[0]!r}, ...) that do not add up to the "
                    f"parameter's shape {tuple(shape)}"
                )
            dtypes = {self._where[k].dtype(k) for k in keys}
            if len(dtypes) != 1:
                raise SourceError(
                    f"infinity.wrap: {name!r}'s per-expert tensors have mixed dtypes {dtypes}"
                )
            self._used.update(keys)
            return keys
        return None

    def _has_plain(self, key: str) -> bool:
        return key in self._where and key not in self._bnb4

    def value(self, names: List[str], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        keys = self._keys(names, shape)
        if len(keys) == 1 and keys[0] in self._bnb4:
            return self._decode(keys[0]).to(dtype)
        if len(keys) == 1:
            return self._where[keys[0]].get_tensor(keys[0]).to(dtype)
        out = torch.empty(shape, dtype=self._where[keys[0]].dtype(keys[0]))
        self.read_into(names, out)
        return out.to(dtype)

    def buffer_value(self, name: str) -> Optional[torch.Tensor]:
        if name not in self._where:
            return None
        self._used.add(name)
        return self._where[name].get_tensor(name)

    def finish(self) -> None:
        unused = sorted(set(self._where) - self._used)
        if unused:
            logger.warning(
                "infinity.wrap: %d tensors of %s were not used by the model: %s",
                len(unused),
                self.path,
                unused[:10],
            )

    def close(self) -> None:
        for handle in self._handles:
            handle.close()
        self._handles.clear()
        self._where.clear()


# ---- initialisation -------------------------------------------------------------------------
Init = Union[str, Callable[[nn.Module], None]]


class InitSource(ParamSource):
    """Initializes meta parameters module by module (named_modules order)."""

    def __init__(self, init: Init) -> None:
        if init != "reset_parameters" and not callable(init):
            raise TypeError("init must be 'reset_parameters' or a callable init(module)")
        self.init = init

    def init_module(self, module: nn.Module) -> None:
        if self.init == "reset_parameters":
            reset = getattr(module, "reset_parameters", None)
            if not callable(reset):
                # its parameters would keep the uninitialized memory they were placed in
                raise SourceError(
                    f"infinity.wrap(init='reset_parameters'): a {type(module).__name__} holds "
                    "parameters on the meta device but has no reset_parameters(), so nothing "
                    "would give them values. Pass init=<a callable init(module)> (for a Hugging "
                    "Face model: init=model._init_weights), or source=<a checkpoint>"
                )
            reset()
        else:
            self.init(module)


def materialize_meta_buffers(model: nn.Module, source: Optional[ParamSource]) -> None:
    """Meta buffers are loaded from the checkpoint when it has them; anything else is an error
    that says how to build the model (parameters on meta, buffers real)."""
    missing = []
    for mod_name, mod in model.named_modules():
        for name, buf in list(mod._buffers.items()):
            if buf is None or not buf.is_meta:
                continue
            qual = f"{mod_name}.{name}" if mod_name else name
            value = source.buffer_value(qual) if source is not None else None
            if value is None:
                missing.append(qual)
                continue
            if tuple(value.shape) != tuple(buf.shape):
                raise SourceError(
                    f"infinity.wrap: buffer {qual!r} has shape "
                    f"{tuple(buf.shape)} but the checkpoint holds "
                    f"{tuple(value.shape)}"
                )
            mod._buffers[name] = value.to(buf.dtype)
    if missing:
        raise SourceError(
            f"infinity.wrap: buffers {missing[:5]} are on the meta device and the source has no "
            "values for them (non-persistent buffers such as rotary frequencies are computed "
            "in __init__). Build the model under `with infinity.empty_init():` (parameters on "
            "meta, buffers real) instead of `with torch.device('meta'):`"
        )


def meta_params(blocks_params: Iterable[nn.Parameter]) -> bool:
    return any(p.is_meta for p in blocks_params)
