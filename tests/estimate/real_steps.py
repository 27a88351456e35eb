"""A real CPU training step measured as live storages, for the tests that hold a trace to it
(test_offload_moments.py, test_op_moments.py, test_adapter_forward.py, test_grad_accum_transient.py)."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from trainmem.models.hf import build_hf_model
from trainmem.specs import ImplSpec, StepSpec
from trainmem.trace.live import LiveStorages
from trainmem.trace.optimizers import make_optimizer_for
from trainmem.trace.torch_state import default_dtype


def real_step(cfg: dict, step: StepSpec, impl: ImplSpec, *, prepare: Callable = lambda model: None,
              forward: Callable = lambda model: contextlib.nullcontext(),
              wrap: Callable = lambda model: model) -> tuple[int, int]:
    """(peak live bytes, Adam's step counters) of a second, steady-state step: the model built as
    ``trace_step`` builds it, ``prepare(model)`` (checkpointing), the forward and loss inside ``forward(model)``
    (offload hooks), ``wrap(model)`` (LoRA) and autocast under amp-bf16; ``step.grad_accum`` micro-batches, each
    backward of ``loss / N`` outside autocast, as trace/step.py ``one_step``. The parameters, buffers, ids and
    optimizer states are the baseline; Adam's fp32 0-dim ``step`` counters are CPU tensors here, which the trace
    leaves out."""
    torch.manual_seed(0)
    with default_dtype(torch.bfloat16 if step.precision == "bf16" else torch.float32):
        model = build_hf_model(cfg, attention=impl.attention)
    model.train()
    prepare(model)
    model = wrap(model)  # fine-tuning: peft's model around it (trace/finetune.py apply_finetune)
    _, _, opt = make_optimizer_for(model, step, impl)
    ids = torch.randint(0, cfg["vocab_size"], (step.batch, step.seq))

    def one():
        for _ in range(step.grad_accum):
            with forward(model), torch.autocast("cpu", dtype=torch.bfloat16, enabled=step.precision == "amp-bf16"):
                loss = model(ids, labels=ids).loss
            (loss / step.grad_accum if step.grad_accum > 1 else loss).backward()
            del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    one()  # states exist from here on
    states = [v for s in opt.state.values() for v in s.values()]
    counters = sum(v.untyped_storage().nbytes() for s in opt.state.values() for k, v in s.items() if k == "step")
    with LiveStorages([*model.parameters(), *model.buffers(), ids, *states]) as live:
        one()
    return live.peak, counters
