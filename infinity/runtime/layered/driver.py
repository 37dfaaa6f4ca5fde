"""Layer-major accumulation: k micro-batches as one optimizer step, each layer fetched once
for forward and once for backward whatever k is (record and replay at layer boundaries).

Design notes: docs/modules.md, runtime/layered/driver.py."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from ..core.block import Block
from ..step.window import AccumulationWindow
from ..vocab.tile_major import NotOneLoss, TailChanged, TileMajor
from .boundary import Boundaries
from .chain import ChainError, check_call, check_model, find_layers, run_layer, split_hidden, tapped

logger = logging.getLogger(__name__)
HOLD_SPARE_DIVISOR = 8  # the host budget's share kept free when the gradient pool grows

LossFn = Callable[[Any, Any], torch.Tensor]
Call = Tuple[Tuple[Any, ...], Dict[str, Any]]  # a layer's recorded arguments besides the hidden


class _Stop(Exception):
    """Raised by the last layer's tap in the record pass: the forward goes no further."""


@dataclass
class _Recorded:
    """One micro-batch after the record pass."""

    embedded: torch.Tensor  # the first layer's input, with its autograd graph
    calls: List[Call]  # per layer
    looked_up: List[torch.Tensor]  # the outputs of the embeddings read by rows, in call order


@dataclass(frozen=True)
class _Pass:
    """What each backward pass of one step runs over."""

    batches: Sequence[Any]
    recorded: List[_Recorded]
    loss_fn: LossFn
    divide_by: float


def call_model(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def default_loss(output: Any, batch: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ChainError(
            "infinity.accumulate: the model's output has no loss (pass labels in each "
            "micro-batch, or loss_fn=lambda output, batch: ... returning a scalar)"
        )
    return loss


class _Rng:
    """The random state a layer's forward saw, replayed for its recomputation."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def save(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        gpu = torch.cuda.get_rng_state(self.device) if self.cuda else None
        return torch.get_rng_state(), gpu

    def load(self, state: Tuple[torch.Tensor, Optional[torch.Tensor]]) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)


class LayerMajor:
    """One layer-major step over ``model`` (``engine``: its infinity engine, or None)."""

    def __init__(self, model: nn.Module, engine: Any = None, *, allow_hooks: bool = False) -> None:
        self.model = model
        self.engine = engine
        blocks: List[Block] = list(engine.blocks) if engine is not None else []
        layer_blocks = [b for b in blocks if b.kind == "layer"]
        self.layers = find_layers(model, [b.module for b in layer_blocks] if engine else None)
        self.layer_blocks: List[Optional[Block]] = list(layer_blocks) or [None] * len(self.layers)
        # blocks the tail (final norm, head, loss) reads whole: held for all micro-batches
        self.tail_blocks = [
            b for b in blocks if b.kind != "layer" and not b.is_root and not b.row_lookup
        ]
        # embeddings read by rows (from NVMe): the tail's forward takes their recorded outputs
        # rather than reading the rows again
        self.row_modules = [
            m for b in blocks if b.row_lookup for m in b.modules if isinstance(m, nn.Embedding)
        ]
        check_model(model, self.layers, allow_hooks)
        device = engine.device if engine is not None else _device_of(model)
        self.rng = _Rng(device)
        self.boundaries = Boundaries(engine, device)
        self.tokens = 0
        self.seconds = (0.0, 0.0)  # the last step's forward and backward
        self.window = AccumulationWindow(engine.step) if engine is not None else None
        # the last layers of forward are the first of backward: as many as the prefetch window
        # (at least one) stay materialized from one to the other, as in the plain loop
        window = engine.schedule.window if engine is not None else 1
        self.kept = max(1, min(window, len(self.layers)))

    # ---- residency (with an engine) --------------------------------------------------------
    def _hold(self, block: Optional[Block]) -> None:
        if block is None:
            return
        with self.engine.step.lock:
            self.engine.group.ensure_on_device(block)
            block.active_forward += 1

    def _let_go(self, block: Optional[Block]) -> None:
        if block is None:
            return
        with self.engine.step.lock:
            block.active_forward = max(0, block.active_forward - 1)
            if block.active_forward == 0:
                self.engine.group.release(block)

    def _prefetch(self, block: Optional[Block]) -> None:
        if block is not None:
            with self.engine.step.lock:
                self.engine.group.prefetch([block.index])

    def _close(self, block: Optional[Block]) -> None:
        if block is not None and self.window is not None:
            self.window.close_block(block)

    def _whole_tables(self, k: int) -> List[Block]:
        """Embeddings read by rows, fetched whole for the record pass instead when several
        micro-batches look them up: k lookups would read up to k tables (a batch's rows touch
        most pieces of the swap file), one fetch reads one. Only where the device budget has
        room; else the rows are read per lookup, as in the plain loop."""
        if self.engine is None or k < 2:
            return []
        held: List[Block] = []
        for block in self.engine.blocks:
            if not block.row_lookup or not any(isinstance(m, nn.Embedding) for m in block.modules):
                continue
            with self.engine.step.lock:
                if not self.engine.device_budget.fits(block.compute_nbytes):
                    continue
            self._hold(block)
            held.append(block)
        return held

    def _hold_layer_grads(self) -> None:
        """Gradients on NVMe: the gradient pool grows (for this step, within the host budget
        left after the boundaries, keeping an eighth of it free) to hold a whole layer's
        gradients, so that the micro-batches add to them in RAM. Where it cannot, the chunks
        that do not fit are written and read back between micro-batches (counted as gradient
        traffic in stats)."""
        if self.engine is None:
            return
        layers = [b for b in self.layer_blocks if b is not None]
        if not layers:
            return
        largest = max(layers, key=lambda b: sum(f.numel for f in b.flats if f.trainable))
        limit = self.engine.host_budget.limit
        spare = limit // HOLD_SPARE_DIVISOR if limit is not None else 0
        self.engine.grads.hold_whole(list(largest.flats), spare)

    # ---- the step --------------------------------------------------------------------------
    def _same_count_on_every_rank(self, k: int) -> None:
        """ZeRO: every rank runs the same collectives in the same order, so every rank must
        pass the same number of micro-batches (one all-reduce each way, before anything)."""
        part = self.engine.partitioner if self.engine is not None else None
        if part is None:
            return
        lo = part.coll.all_reduce_scalar(float(k), "min", replicas=True)
        hi = part.coll.all_reduce_scalar(float(k), "max", replicas=True)
        if lo != hi:
            raise ChainError(
                f"infinity.accumulate: the ranks were given different numbers of "
                f"micro-batches ({int(lo)} to {int(hi)}; this rank {k}). Under ZeRO every rank "
                "runs the same collectives, so every rank must pass the same number: split "
                "the global batch evenly (drop_last=True) or pad the short rank's"
            )

    def run(
        self,
        batches: Sequence[Any],
        loss_fn: LossFn,
        divide_by: float,
        between: Optional[Callable[[], bool]] = None,
    ) -> List[torch.Tensor]:
        """The step's forward and backward. ``between``: the backward runs twice over the
        same forward (layer inputs kept, dropout replayed): ``between()`` runs after the first
        one ended (its gradients complete) and says whether the second runs."""
        engine = self.engine
        self._same_count_on_every_rank(len(batches))
        if self.window is not None:
            self.window.open()
        failed = True
        try:
            with torch.enable_grad():
                losses = self._run(batches, loss_fn, divide_by, between)
            failed = False
            return losses
        finally:
            self.boundaries.clear()
            if engine is not None:
                engine.grads.end_hold()
            if self.window is not None:
                self.window.close(failed=failed)
                if not failed:
                    engine.stats.note_tokens(
                        self.tokens, self.boundaries.peak, len(batches), self.seconds
                    )

    def _run(
        self,
        batches: Sequence[Any],
        loss_fn: LossFn,
        divide_by: float,
        between: Optional[Callable[[], bool]],
    ) -> List[torch.Tensor]:
        n = len(self.layers)
        t0 = time.perf_counter()
        held = self._whole_tables(len(batches))
        try:
            recorded = [self._record(m, batch) for m, batch in enumerate(batches)]
        finally:
            for block in held:
                self._let_go(block)
        self.tokens = sum(r.embedded.shape[:-1].numel() for r in recorded)
        self.boundaries.check_fits(recorded[0].embedded, n, len(batches), self.tokens)
        self._hold_layer_grads()
        for m, r in enumerate(recorded):
            self.boundaries.put(0, m, r.embedded.detach())
        self._forward(recorded)
        t1 = time.perf_counter()
        again = between is not None
        step = _Pass(batches, recorded, loss_fn, divide_by)
        losses = self._backward_pass(step, keep=again)
        if again and between is not None:
            if self.window is not None:  # the first pass's gradients end like a backward's
                self.window.close(failed=False)
            go_on = between()
            if self.window is not None:
                self.window.open()
            if go_on:
                self._backward_pass(step, keep=False, cold=True)
        self.seconds = (t1 - t0, time.perf_counter() - t1)
        logger.debug(
            "infinity.accumulate: %d micro-batches, %d layers: forward %.3f s, backward %.3f s",
            len(batches),
            n,
            *self.seconds,
        )
        return losses

    def _backward_pass(self, step: _Pass, *, keep: bool, cold: bool = False) -> List[torch.Tensor]:
        """The tail per micro-batch, the layers' backward, then what ran before the first
        layer; every block closed. ``keep``: the layer inputs, RNG states and the embedding
        graph stay for another pass; ``cold``: no layer is held over from the forward."""
        losses, grads = self._tail(step, keep)
        grads = self._backward(step.recorded, grads, keep, cold)
        # phase 5: what ran before the first layer; the rows the micro-batches looked up are
        # added to the gradient tier once (the last micro-batch's lookup adds them all)
        ends = [(r.embedded, g) for r, g in zip(step.recorded, grads)]
        ends = [(e, g) for e, g in ends if e.requires_grad and g is not None]
        rows = self.engine.rows.gathered(len(ends)) if self.engine is not None else nullcontext()
        with rows:
            for embedded, g in ends:
                torch.autograd.backward(embedded, g, retain_graph=keep)
        if self.engine is not None:  # the root last: whatever the step's backward ran
            for block in sorted(self.engine.blocks, key=lambda b: b.is_root):
                self._close(block)
        return losses

    def _record(self, m: int, batch: Any) -> _Recorded:
        n = len(self.layers)
        calls: List[Call] = []
        seen: Dict[str, Any] = {"embedded": None, "last": None}

        def tap(i: int, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
            hidden, rest, kw = split_hidden(i, args, kwargs)
            if i != len(calls):
                raise _chain_broken(f"layer {i} ran where layer {len(calls)} was expected")
            if i == 0:
                seen["embedded"] = hidden
            elif hidden is not seen["last"]:
                raise _chain_broken(
                    f"layer {i}'s input is not layer {i - 1}'s output (the model changes the "
                    "hidden state between layers)"
                )
            check_call(i, rest, kw)
            calls.append((rest, kw))
            if i == n - 1:
                raise _Stop
            seen["last"] = hidden
            return hidden

        looked_up: List[torch.Tensor] = []
        hooks = [
            m.register_forward_hook(lambda mod, args, out: looked_up.append(out))
            for m in self.row_modules
        ]
        try:
            with tapped(self.layers, tap):
                call_model(self.model, batch)
        except _Stop:
            return _Recorded(seen["embedded"], calls, looked_up)
        except ChainError:
            raise
        except Exception as exc:
            raise ChainError(
                f"infinity.accumulate: micro-batch {m} failed in the model's forward "
                f"({type(exc).__name__}: {exc}); nothing was changed. Check that every "
                "micro-batch is a batch the model takes on its own"
            ) from exc
        finally:
            for h in hooks:
                h.remove()
        raise _chain_broken(f"the model's forward ran {len(calls)} of its {n} layers")

    def _forward(self, recorded: List[_Recorded]) -> None:
        n, k = len(self.layers), len(recorded)
        blocks = self.layer_blocks
        for i in range(n):
            self._hold(blocks[i])
            if i + 1 < n:
                self._prefetch(blocks[i + 1])
            try:
                with torch.no_grad():
                    for m in range(k):
                        rest, kw = recorded[m].calls[i]
                        self.boundaries.put_rng(i, m, self.rng.save())
                        out = run_layer(self.layers[i], self.boundaries.get(i, m), rest, kw)
                        self.boundaries.put(i + 1, m, out)
            finally:
                if i < n - self.kept:  # the last ones' backward comes first: kept
                    self._let_go(blocks[i])

    def _tail(
        self, step: _Pass, keep: bool
    ) -> Tuple[List[torch.Tensor], List[Optional[torch.Tensor]]]:
        """Each micro-batch's tail (final norm, head, loss) and its backward to the last
        layer's output: the losses, and the gradients of the last layer's outputs."""
        n = len(self.layers)
        for block in self.tail_blocks:
            self._hold(block)
        try:
            k = len(step.batches)
            tiled = self.engine is not None and self.engine.tiled_head is not None and k > 1
            # the last layer's outputs: all at once where the tails may run tile-major
            lasts = [self.boundaries.use(n, m, keep) for m in range(k)] if tiled else None
            tiles = self._tile_major(step, lasts) if lasts is not None else None
            if tiles is None:
                losses, grads = self._tails_one_by_one(step, keep, lasts)
            else:
                losses, grads = self._tails_tile_major(step, lasts or [], tiles)
        finally:
            for block in self.tail_blocks:
                self._let_go(block)
        if self.engine is not None:
            for block in self.tail_blocks:
                if not block.shared:  # a tied head's gradient completes with the embedding's
                    self._close(block)
        return losses, grads

    def _tail_loss(self, step: _Pass, m: int, last: torch.Tensor) -> torch.Tensor:
        """Micro-batch ``m``'s tail: the model's forward with the layers skipped (the last
        one gives ``last``) and the embeddings' recorded lookups, then the loss."""
        n = len(self.layers)
        batch = step.batches[m]
        looked_up = iter(step.recorded[m].looked_up)

        def tap(i: int, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
            hidden, _, _ = split_hidden(i, args, kwargs)
            return last if i == n - 1 else hidden

        def lookup(i: int, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
            out = next(looked_up, None)
            if out is None:
                raise _chain_broken("the model's forward looks up its embeddings twice")
            return out.detach()  # what the record pass read: not read again

        with tapped(self.layers, tap), tapped(self.row_modules, lookup):
            output = call_model(self.model, batch)
        loss = step.loss_fn(output, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ChainError(
                "infinity.accumulate: loss_fn must return a scalar tensor, got "
                f"{type(loss).__name__}"
            )
        return loss

    @staticmethod
    def _grad_of_last(last: torch.Tensor) -> torch.Tensor:
        if last.grad is None:
            raise _chain_broken("the loss does not depend on the last layer's output")
        return last.grad

    def _tails_one_by_one(
        self, step: _Pass, keep: bool, lasts: Optional[List[torch.Tensor]]
    ) -> Tuple[List[torch.Tensor], List[Optional[torch.Tensor]]]:
        n = len(self.layers)
        losses: List[torch.Tensor] = []
        grads: List[Optional[torch.Tensor]] = []
        for m in range(len(step.batches)):
            last = lasts[m] if lasts is not None else self.boundaries.use(n, m, keep)
            loss = self._tail_loss(step, m, last.requires_grad_(True))
            losses.append(loss.detach())
            torch.autograd.backward(loss / step.divide_by)
            grads.append(self._grad_of_last(last))
        return losses, grads

    def _tile_major(self, step: _Pass, lasts: List[torch.Tensor]) -> Optional[TileMajor]:
        """With the LM head tiled and several micro-batches: each tail's forward without
        autograd, recording its tiled loss (tile_major.py), then the losses swept tile by
        tile. None (nothing swept) where a tail's loss is not one tiled cross-entropy."""
        tiles = TileMajor()
        rng = self.rng.save()
        try:
            with tiles.collecting():
                for m, last in enumerate(lasts):
                    before = len(tiles.items)
                    self._tail_loss(step, m, last)
                    if len(tiles.items) != before + 1:
                        raise NotOneLoss
        except NotOneLoss:
            return None
        finally:
            self.rng.load(rng)  # the next run of the tails draws what this one drew
        tiles.losses()
        return tiles

    def _tails_tile_major(
        self, step: _Pass, lasts: List[torch.Tensor], tiles: TileMajor
    ) -> Tuple[List[torch.Tensor], List[Optional[torch.Tensor]]]:
        losses: List[torch.Tensor] = []
        scaled: List[torch.Tensor] = []
        try:
            with tiles.replaying_tails():
                for m, last in enumerate(lasts):
                    loss = self._tail_loss(step, m, last.requires_grad_(True))
                    losses.append(loss.detach())
                    scaled.append(loss / step.divide_by)
                    tiles.gradient_of(scaled[-1])
            tiles.gradients()
            for s in scaled:
                torch.autograd.backward(s)
        except TailChanged as exc:
            raise ChainError(
                f"infinity.accumulate: the model's tail (final norm, LM head, loss) ran twice "
                f"per micro-batch to sweep the tiled head once for all of them, and {exc}. "
                "Use a deterministic tail, or the plain micro-batch loop"
            ) from exc
        return losses, [self._grad_of_last(last) for last in lasts]

    def _backward(
        self,
        recorded: List[_Recorded],
        grads: List[Optional[torch.Tensor]],
        keep: bool,
        cold: bool,
    ) -> List[Optional[torch.Tensor]]:
        n, k = len(self.layers), len(recorded)
        blocks = self.layer_blocks
        needs_input = any(r.embedded.requires_grad for r in recorded)
        if cold:
            self._prefetch(blocks[n - 1])
        for i in reversed(range(n)):
            if cold or i < n - self.kept:
                self._hold(blocks[i])
            if i > 0:
                self._prefetch(blocks[i - 1])
            now = self.rng.save()
            try:
                for m in range(k):
                    rest, kw = recorded[m].calls[i]
                    x = self.boundaries.use(i, m, keep)
                    if i > 0 or needs_input:
                        x.requires_grad_(True)
                    self.rng.load(self.boundaries.rng(i, m, keep))
                    y = run_layer(self.layers[i], x, rest, kw)
                    if y.requires_grad and grads[m] is not None:
                        torch.autograd.backward(y, grads[m])
                    grads[m] = x.grad if x.requires_grad else None
                    del y, x
            finally:
                self.rng.load(now)
                self._let_go(blocks[i])
            self._close(blocks[i])
        return grads


def _chain_broken(why: str) -> ChainError:
    return ChainError(
        f"infinity.accumulate: {why}. Layer-major accumulation needs a model whose layers form "
        "a chain; run the plain micro-batch loop instead"
    )


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
