"""Where the values of a model built on the meta device come from, one block at a time.

``infinity.wrap(meta_model, source=...)`` never materializes the whole model: before a block's
flat buffers are filled, the source turns that block's meta parameters into real CPU tensors
(new ``nn.Parameter`` objects, set on every module that shares them), the home is filled from
them, and they are freed again when the parameters are pointed at their homes.

- :class:`CheckpointSource`: a ``.safetensors`` file, a sharded set with its
  ``*.safetensors.index.json``, or a Hugging Face model folder, read by memory map, converted
  to the model's dtypes.
- :class:`InitSource`: the modules' own ``reset_parameters`` (or the user's ``init(module)``),
  run module by module in ``model.named_modules()`` order, so with the same seed the values
  equal a CPU construction that initializes its modules in that order.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple, Union

import torch
from torch import nn

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
            raise SourceError(f"infinity.wrap(source={path!r}): the folder holds no "
                              "model.safetensors, model.safetensors.index.json or *.safetensors "
                              "file; save the model with save_pretrained(safe_serialization="
                              "True) or safetensors.torch.save_file")
        return [os.path.join(path, f) for f in found]
    if path.endswith(".json"):
        try:
            with open(path, "r", encoding="utf-8") as fh:
                index = json.load(fh)
            files = sorted(set(index["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SourceError(f"infinity.wrap(source={path!r}): not a safetensors index "
                              f"(needs a 'weight_map'): {exc}") from None
        base = os.path.dirname(path)
        return [os.path.join(base, f) for f in files]
    if path.endswith(".safetensors"):
        return [path]
    raise SourceError(f"infinity.wrap(source={path!r}): expected a .safetensors file, a "
                      "*.safetensors.index.json or a Hugging Face model folder")


class CheckpointSource(ParamSource):
    def __init__(self, path: Union[str, os.PathLike]) -> None:
        from safetensors import safe_open  # an optional dependency, needed only here

        self.path = os.fspath(path)
        self._handles = []
        self._where: Dict[str, object] = {}
        try:
            for file in _checkpoint_files(self.path):
                try:
                    handle = safe_open(file, framework="pt")
                except Exception as exc:  # noqa: BLE001 - safetensors raises its own types
                    raise SourceError(f"infinity.wrap: cannot read safetensors file {file!r}: "
                                      f"{exc}") from None
                self._handles.append(handle)
                for key in handle.keys():
                    self._where[key] = handle
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

    def value(self, names: List[str], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        key = self._find(names)
        if key is None:
            raise SourceError(f"infinity.wrap: parameter {names[0]!r} is not in the checkpoint "
                              f"{self.path!r}" + (f" (also looked for {names[1:]})"
                                                  if len(names) > 1 else "")
                              + "; check that the checkpoint belongs to this model")
        tensor = self._where[key].get_tensor(key)
        if tuple(tensor.shape) != tuple(shape):
            raise SourceError(f"infinity.wrap: checkpoint {self.path!r} holds {key!r} with shape "
                              f"{tuple(tensor.shape)} but the model's parameter has shape "
                              f"{tuple(shape)}")
        self._used.update(n for n in names if n in self._where)
        return tensor.to(dtype)

    def buffer_value(self, name: str) -> Optional[torch.Tensor]:
        if name not in self._where:
            return None
        self._used.add(name)
        return self._where[name].get_tensor(name)

    def finish(self) -> None:
        unused = sorted(set(self._where) - self._used)
        if unused:
            logger.warning("infinity.wrap: %d tensors of %s were not used by the model: %s",
                           len(unused), self.path, unused[:10])

    def close(self) -> None:
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
            if callable(reset):
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
                raise SourceError(f"infinity.wrap: buffer {qual!r} has shape "
                                  f"{tuple(buf.shape)} but the checkpoint holds "
                                  f"{tuple(value.shape)}")
            mod._buffers[name] = value.to(buf.dtype)
    if missing:
        raise SourceError(
            f"infinity.wrap: buffers {missing[:5]} are on the meta device and the source has no "
            "values for them (non-persistent buffers such as rotary frequencies are computed "
            "in __init__). Build the model under `with infinity.empty_init():` (parameters on "
            "meta, buffers real) instead of `with torch.device('meta'):`")


def meta_params(blocks_params: Iterable[nn.Parameter]) -> bool:
    return any(p.is_meta for p in blocks_params)
