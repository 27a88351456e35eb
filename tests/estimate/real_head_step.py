"""A real CPU step of a classification or masked-LM model measured as live storages (``LiveStorages``), for the
tests that hold the estimate and the trace to it (test_encoder_backward.py, test_heads_peak.py)."""

from __future__ import annotations

import torch

from trainmem.models.hf import build_hf_model
from trainmem.specs import ImplSpec, StepSpec
from trainmem.trace.live import LiveStorages
from trainmem.trace.optimizers import _make_optimizer


def real_head_step(cfg: dict, head: str, step: StepSpec, impl: ImplSpec) -> tuple[int, int, int]:
    """(peak of the second step, bytes of the optimizer's fp32 step counters, parameter count): AdamW, ids in
    [1, V), labels a class per sequence (seq-cls), per token (token-cls) or a token id (mlm); the forward and loss
    under CPU autocast at amp-bf16 (the backward outside, as trace/step.py)."""
    torch.manual_seed(0)
    model = build_hf_model(cfg, head=head, dtype=torch.bfloat16 if step.precision == "bf16" else None)
    model.train()
    opt = _make_optimizer("adamw", list(model.parameters()), impl.optimizer_impl)
    B, S = step.batch, step.seq
    ids = torch.randint(1, cfg["vocab_size"], (B, S))
    high = cfg["vocab_size"] if head == "mlm" else cfg["num_labels"]
    labels = torch.randint(0, high, (B,) if head == "seq-cls" else (B, S))

    def one():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step.precision == "amp-bf16"):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    one()  # the optimizer's states exist from here on
    states = [v for s in opt.state.values() for v in s.values()]
    steps = sum(v.untyped_storage().nbytes() for s in opt.state.values() for k, v in s.items() if k == "step")
    with LiveStorages([*model.parameters(), *model.buffers(), ids, labels, *states]) as live:
        one()
    return live.peak, steps, len(list(model.parameters()))
