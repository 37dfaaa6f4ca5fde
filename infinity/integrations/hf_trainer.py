"""``LayerMajorTrainer``: Hugging Face ``Trainer`` with ``gradient_accumulation_steps`` run as
one layer-major step (``infinity.accumulate``).

Design notes: docs/modules.md, integrations/hf_trainer.py."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

import torch

from ..accumulation import accumulate
from ..api import stats
from ..optim.adam import OffloadedAdam
from ..runtime.core.registry import engine_of

try:  # transformers is optional: the class exists only where it is installed
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - exercised where transformers is missing
    raise ImportError(
        "infinity.integrations.hf_trainer needs transformers (pip install transformers)"
    ) from exc


class LayerMajorTrainer(Trainer):
    """A ``transformers.Trainer`` whose accumulated micro-batches run layer-major."""

    def __init__(self, *args: Any, step_in_backward: bool = True, **kwargs: Any) -> None:
        """``step_in_backward``: with infinity's optimizer and a clip, take the step in
        backward (two backward passes, no gradient written); False: the gradients are written
        and the Trainer clips and steps after backward (one pass: faster where compute is the
        bottleneck, a CPU; see the module docstring)."""
        if not isinstance(step_in_backward, bool):
            raise TypeError(
                f"infinity LayerMajorTrainer: step_in_backward must be True or False, got "
                f"{step_in_backward!r}"
            )
        super().__init__(*args, **kwargs)
        self.step_in_backward = step_in_backward
        self._step_batches: Optional[List[Dict[str, Any]]] = None
        self._step_losses: Optional[Iterator[torch.Tensor]] = None
        self._step_norm: Optional[float] = None  # the norm of a step taken in backward
        self._check_supported()

    def _check_supported(self) -> None:
        why = None
        if type(self).compute_loss is not Trainer.compute_loss:
            why = "a subclass overriding compute_loss"
        elif self.compute_loss_func is not None:
            why = "compute_loss_func"
        elif self.label_smoother is not None:
            why = "label smoothing (label_smoothing_factor)"
        elif getattr(self.args, "n_gpu", 1) > 1:
            why = "DataParallel over several GPUs (n_gpu > 1)"
        if why is not None:
            raise ValueError(
                f"infinity LayerMajorTrainer: {why} is not supported by layer-major "
                "accumulation; use transformers.Trainer (the plain micro-batch loop), which "
                "infinity runs unchanged"
            )

    def get_batch_samples(self, epoch_iterator, num_batches, device):  # type: ignore[override]
        batch_samples, num_items_in_batch = super().get_batch_samples(
            epoch_iterator, num_batches, device
        )
        self._step_batches = list(batch_samples)
        self._step_losses = None
        return batch_samples, num_items_in_batch

    def training_step(  # type: ignore[override]
        self, model: torch.nn.Module, inputs: Dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        batches = self._step_batches
        if batches is None or not any(inputs is b for b in batches):
            raise RuntimeError(
                "infinity LayerMajorTrainer: training_step was called with a batch that is not "
                "one of the optimizer step's micro-batches (get_batch_samples); call the "
                "Trainer's own training loop (trainer.train())"
            )
        if inputs is batches[0]:
            self._step_losses = self._run_step(model, batches, num_items_in_batch)
        if self._step_losses is None:
            raise RuntimeError("infinity LayerMajorTrainer: micro-batches out of order")
        return next(self._step_losses)

    def _run_step(
        self, model: torch.nn.Module, batches: List[Dict[str, Any]], num_items_in_batch: Any
    ) -> Iterator[torch.Tensor]:
        model.train()
        train = getattr(self.optimizer, "train", None)
        if callable(train):  # schedule-free optimizers
            train()
        prepared = [self._prepare_inputs(b) for b in batches]
        scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        if scaled:  # the model divides each micro-batch's token sum by the step's count
            prepared = [dict(b, num_items_in_batch=num_items_in_batch) for b in prepared]
        if self.loss_is_scaled_for_ga is not None:
            scaled = self.loss_is_scaled_for_ga
        divide_by = 1.0 if scaled else float(self.current_gradient_accumulation_steps)
        # infinity's optimizer on a wrapped model that clips: the step is taken in backward,
        # each block from RAM (no gradient written); the Trainer's clip returns its norm and
        # its optimizer.step() does nothing then
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        clip = self.args.max_grad_norm
        taker = inner if isinstance(inner, OffloadedAdam) and clip > 0 else None
        if engine_of(model) is None or not self.step_in_backward:
            taker = None
        self._step_norm = None
        with self.compute_loss_context_manager():
            if taker is not None:
                losses = accumulate(
                    model, prepared, divide_by=divide_by, optimizer=taker, max_grad_norm=clip
                )
                self._step_norm = stats(model)["accumulate"]["grad_norm"]
                taker.skip_next_step()
            else:
                losses = accumulate(model, prepared, divide_by=divide_by)
        # what Trainer.training_step returns: the loss it ran backward on
        return iter([loss / divide_by for loss in losses])

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        if isinstance(inner, OffloadedAdam):  # its state files' spare blocks: room for the save
            inner.give_back_disk()
        super()._save_optimizer_and_scheduler(output_dir)

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:  # type: ignore[override]
        if self._step_norm is not None:  # clipped in the step taken in backward
            norm, self._step_norm = self._step_norm, None
            return torch.tensor(norm)
        return super()._clip_grad_norm(model)
