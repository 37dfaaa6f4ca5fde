"""Matching a checkpoint to the model and optimizer it is loaded into: which saved tensor feeds
each of the model's tensors (:class:`TensorPlan`) and the saved optimizer state by parameter
names (:class:`OptimizerPlan`). A mismatch raises one error listing every difference."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import torch

from .disk.manifest import CheckpointMismatchError, decode
from .disk.pieces import Source
from .names import ModelNames

logger = logging.getLogger(__name__)

_LIST_LIMIT = 20


def _listing(title: str, items: List[str]) -> str:
    shown = ", ".join(items[:_LIST_LIMIT])
    more = f", ... and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else ""
    return f"\n  {title} ({len(items)}): {shown}{more}"


class TensorPlan:
    """Which saved tensor feeds each of the model's tensors."""

    def __init__(
        self, manifest: Dict[str, Any], names: ModelNames, root: str, strict: bool
    ) -> None:
        saved: Dict[str, Any] = manifest["tensors"]
        saved_aliases: Dict[str, str] = manifest.get("aliases", {})
        self.saved = saved
        self.source: Dict[str, str] = {}  # model name -> saved name
        missing, mismatched = [], []
        matched = set()
        for name, t in names.tensors.items():
            src = name if name in saved else saved_aliases.get(name)
            if src is None or src not in saved:
                missing.append(name)
                continue
            matched.add(src)
            shape = tuple(saved[src]["shape"])
            if shape != tuple(t.shape):
                mismatched.append(f"{name}: checkpoint {shape} vs model {tuple(t.shape)}")
                continue
            self.source[name] = src
        # a tensor saved under a name the model ties to another one is not unexpected: it is
        # the same parameter (loaded once, from its first name), as with load_state_dict
        used = matched | {n for n in saved if n in names.aliases}
        unexpected = [n for n in saved if n not in used]
        if mismatched or (strict and (missing or unexpected)):
            msg = (
                f"checkpoint {root} (saved from {manifest.get('model_class')}) does not match "
                f"the model {type(names.model).__module__}.{type(names.model).__qualname__}:"
            )
            if missing:
                msg += _listing("missing in the checkpoint", missing)
            if unexpected:
                msg += _listing("unexpected in the checkpoint", unexpected)
            if mismatched:
                msg += _listing("shape mismatch", mismatched)
            if not mismatched:
                msg += "\nPass strict=False to load the tensors that match."
            raise CheckpointMismatchError(msg)
        if missing or unexpected:
            logger.warning(
                "infinity: loading %s non-strictly: %d model tensors missing in it, "
                "%d of its tensors unused",
                root,
                len(missing),
                len(unexpected),
            )


class OptimizerPlan:
    """The saved optimizer state, matched to ``optimizer`` by parameter names."""

    def __init__(
        self,
        section: Dict[str, Any],
        optimizer: torch.optim.Optimizer,
        names: ModelNames,
        root: str,
    ) -> None:
        self.optimizer = optimizer
        self.names = names.optimizer_names(optimizer)
        self.groups = decode(section["param_groups"])
        self.states: Dict[str, Any] = section["states"]
        current = [[self.names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        saved = [list(g["params"]) for g in self.groups]
        if current != saved:
            if len(current) != len(saved):
                why = f"it has {len(saved)} param groups, the optimizer has {len(current)}"
            else:
                n = next(i for i, (a, b) in enumerate(zip(current, saved)) if a != b)
                only_saved = [x for x in saved[n] if x not in current[n]]
                only_here = [x for x in current[n] if x not in saved[n]]
                why = (
                    f"param group {n} differs"
                    + _listing("only in the checkpoint", only_saved)
                    + _listing("only in the optimizer", only_here)
                    + (
                        "\n  (same parameters in another order)"
                        if not only_saved and not only_here
                        else ""
                    )
                )
            raise CheckpointMismatchError(
                f"the optimizer state in checkpoint {root} was saved for other parameters: {why}"
            )

    def entry(self, source: Source, name: str, copy: bool = False) -> Optional[Dict[str, Any]]:
        record = self.states.get(name)
        if record is None:
            return None
        out = {k: decode(v) for k, v in record["values"].items()}
        if "pieces" in record:  # saved by ranks: assembled from their pieces
            shape = source.tensors[name]["shape"]
            for key in ("exp_avg", "exp_avg_sq", "master"):
                t = source.state(name, key)
                if t is not None:
                    out[key] = t.view(shape)
            return out
        for key, rel in record["tensors"].items():
            t = source.reader.tensor(rel, f"{name}::{key}")
            out[key] = t.clone() if copy else t
        return out

    def torch_state_dict(self, source: Source, skip=lambda p: False) -> Dict[str, Any]:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = {}
        for i, p in enumerate(params):
            if not skip(p):
                e = self.entry(source, self.names[id(p)], copy=True)
                if e is not None:
                    state[i] = e
        groups, start = [], 0
        for g in self.groups:
            groups.append(
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": list(range(start, start + len(g["params"]))),
                }
            )
            start += len(g["params"])
        return {"state": state, "param_groups": groups}

    def shard_entries(self, source: Source, shard: Any) -> Dict[int, Dict[str, Any]]:
        per_slot = {}
        for i, slot in enumerate(shard.flat.slots):
            if shard.groups[i] is None:
                continue
            e = self.entry(source, self.names[id(slot.param)])
            if e is not None:
                per_slot[i] = e
        return per_slot
