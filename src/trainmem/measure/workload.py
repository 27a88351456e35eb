"""A real training step to measure: model, optimizer, fixed batches, precision recipe.

``build_workload`` makes the same step ``trainmem.trace.trace_step`` records, but on real
tensors on a real device: ``loss = model(ids, labels=ids).loss; loss.backward()`` per
micro-batch, then ``optimizer.step(); optimizer.zero_grad(set_to_none=True)``. Weights and
batches come from a fixed seed, so two workloads that differ only in kernels, recompute or
precision see the same numbers (what :mod:`trainmem.measure.variants` compares).

The frameworks' chunked losses (``--loss torchtune-chunked-ce|litgpt-chunked-ce``) run as the
tracer runs them (:func:`trainmem.trace.losses.framework_loss`): the decoder, the output projection
per chunk and the framework's cross-entropy, with LitGPT's logits held until the optimizer step.

Known limitations: MoE routing and trainmem's own ``chunked-ce``/``fused-ce`` losses are not built
here (the same limits as the tracer; bitsandbytes' and torchao's optimizers are,
:mod:`trainmem.trace.low_bit_optim`); data parallelism wraps the model in DDP only when a process
group is already initialised, and then the frameworks' chunked losses are refused (they call the
decoder and the head apart, around DDP's forward).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from trainmem.errors import UnsupportedError
from trainmem.specs.step import FRAMEWORK_LOSSES
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

__all__ = ["Workload", "build_workload", "resolve_device", "ledger_bytes"]

#: ``probe(event)`` is called with "forward_start", "forward_end" (only ``loss`` kept) and
#: "backward_end" around the first micro-batch of a step.
Probe = Callable[[str], None]


def resolve_device(device: str | None = None):
    """``"auto"``/None: CUDA when available, else CPU."""
    import torch

    if device in (None, "auto"):
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedError("device cuda: no CUDA device is visible to torch (use --run-on cpu)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise UnsupportedError(f"device {device!r}: measuring supports cuda and cpu")
    return dev


def _dtype(name: str):
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _attention_context(impl: ImplSpec):
    """Pin the SDPA backend a Hugging Face model runs (the reference model pins its own)."""
    backend = {"flash": "FLASH_ATTENTION", "sdpa-math": "MATH", "mem-efficient": "EFFICIENT_ATTENTION"}.get(
        impl.attention)
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, backend)])


def _storages(tensors) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        if t is not None and hasattr(t, "untyped_storage"):
            st = t.untyped_storage()
            out[st._cdata] = st.nbytes()
    return out


def ledger_bytes(model, optimizer) -> dict[str, int]:
    """Parameters, master weights (optimizer parameters that are not model parameters) and
    optimizer state, de-duplicated by storage (tied embeddings count once)."""
    params = _storages(model.parameters())
    opt_params = _storages(p for g in optimizer.param_groups for p in g["params"]) if optimizer else {}
    masters = {k: v for k, v in opt_params.items() if k not in params}
    state = _storages(v for s in (optimizer.state.values() if optimizer else ()) for v in s.values()
                      if hasattr(v, "untyped_storage") and v.dim() > 0)
    return {"parameter": sum(params.values()), "master_weight": sum(masters.values()),
            "optimizer_state": sum(state.values())}


@dataclass
class Workload:
    """A built training step. ``run_step`` runs one optimizer step and returns its mean loss."""

    model: Any
    optimizer: Any
    step: StepSpec
    impl: ImplSpec
    device: Any
    ids: Any  # (B·grad_accum, S) int64 on device, fixed by the seed
    params: list
    masters: list | None
    context: Callable[[], Any] = contextlib.nullcontext
    ignore_labels: Any = None
    """torchtune's ``ignore_labels_cache`` (B, 1), made once at setup as its recipe does."""
    held: Any = None
    """LitGPT's logits, kept bound through backward and the optimizer step (``HeldLogits``)."""
    grad_norms: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> int:
        return self.step.batch * self.step.grad_accum * self.step.seq

    def run_step(self, probe: Probe | None = None, *, grad_norm: bool = False) -> float:
        import torch

        dt = self.step.dtypes
        B, A = self.step.batch, self.step.grad_accum
        autocast = (torch.autocast(self.device.type, dtype=_dtype(dt.activation)) if dt.autocast
                    else contextlib.nullcontext())
        no_sync = getattr(self.model, "no_sync", None)
        total = 0.0
        with self.context():
            for i in range(A):
                mb = self.ids[i * B:(i + 1) * B]  # (B, S)
                sync = no_sync() if (no_sync is not None and i < A - 1) else contextlib.nullcontext()
                with sync:
                    if probe and i == 0:
                        probe("forward_start")
                    with autocast:
                        loss = self._loss(mb)
                    if probe and i == 0:
                        probe("forward_end")
                    (loss / A if A > 1 else loss).backward()
                    if probe and i == 0:
                        probe("backward_end")
                total += float(loss.detach())
                del loss
            if grad_norm:
                with torch.no_grad():
                    sq = sum(float(torch.linalg.vector_norm(p.grad, dtype=torch.float32)) ** 2
                             for p in self.params if p.grad is not None)
                self.grad_norms.append(sq ** 0.5)
            if self.masters is not None:
                for m, p in zip(self.masters, self.params):
                    m.grad = p.grad.to(m.dtype) if p.grad is not None else None
                    p.grad = None
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.held is not None:
                self.held.clear()
            if self.masters is not None:
                with torch.no_grad():
                    for m, p in zip(self.masters, self.params):
                        p.copy_(m)
        self.losses.append(total / A)
        return total / A

    def _loss(self, mb):
        """The micro-batch's loss: the model's own, or a framework's chunked loss as the tracer runs it."""
        if self.step.loss in FRAMEWORK_LOSSES:
            from trainmem.trace.losses import framework_loss
            return framework_loss(self.step.loss, self.model, mb, ignore_labels=self.ignore_labels, held=self.held)
        return self.model(mb, labels=mb).loss

    def close(self) -> None:
        """Drop every tensor this workload holds (so a sweep can build the next one)."""
        self.model = self.optimizer = self.ids = None
        self.params = []
        self.masters = None
        self.context = contextlib.nullcontext  # its closure holds the model


def _build_model(source, step: StepSpec, impl: ImplSpec, device):
    import torch

    from trainmem.trace.torch_state import default_dtype

    dt = _dtype(step.dtypes.param)
    if isinstance(source, ModelSpec):
        from trainmem.models.reference import build_reference_model
        if impl.profile != "reference":
            impl = replace(impl, profile="reference")
        with torch.device(device), default_dtype(dt):
            model = build_reference_model(source, replace(impl, device=device.type))
        return model, source.vocab_size, True
    if isinstance(source, Mapping):
        if impl.profile == "megatron":
            raise UnsupportedError("profile='megatron' is an accounting model, not code that can run; "
                                   "measure profile 'hf' or 'reference'")
        from trainmem.models.hf import build_hf_model
        with torch.device(device), default_dtype(dt):
            model = build_hf_model(source, attention=impl.attention)
        return model, model.config.vocab_size, False
    vocab = getattr(getattr(source, "config", None), "vocab_size", None)
    if not vocab:
        raise UnsupportedError(f"{type(source).__name__} has no config.vocab_size; "
                               "use trainmem.measure.profile(step_fn, ...) for custom models")
    return source.to(device), vocab, False


def build_workload(source, step: StepSpec | None = None, impl: ImplSpec | None = None, *,
                   device=None, seed: int = 0) -> Workload:
    """Build model, optimizer and fixed batches on ``device``.

    ``source`` is a :class:`ModelSpec` (trainmem's reference model), a ``config.json`` dict
    (a Hugging Face model) or an ``nn.Module`` called as ``model(ids, labels=ids).loss``.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover
        raise UnsupportedError("measuring needs torch: pip install 'trainmem[torch]'") from None
    from trainmem.trace.optimizers import make_optimizer_for
    from trainmem.trace.recompute import enable_recompute, selective_recompute
    from trainmem.trace.step import _check

    step = step or StepSpec()
    impl = impl or ImplSpec()
    _check(step, replace(impl, attention="sdpa"))  # mem-efficient is fine on CUDA
    dev = resolve_device(device) if not hasattr(device, "type") else device
    if impl.attention == "mem-efficient" and dev.type != "cuda":
        raise UnsupportedError("attention='mem-efficient' has no CPU kernel; use flash or sdpa-math on CPU")
    torch.manual_seed(seed)
    if dev.type == "cuda":
        torch.cuda.manual_seed(seed)
    model, vocab, reference = _build_model(source, step, impl, dev)
    model.train()
    if not reference:
        enable_recompute(model, impl)
    if impl.float8 != "none":  # torchao's conversion, as the tracer applies it (trace/float8.py)
        from trainmem.trace.float8 import convert_float8
        convert_float8(model, impl)
    params, masters, optimizer = make_optimizer_for(model, step, impl)
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if step.loss in FRAMEWORK_LOSSES:
            raise UnsupportedError(f"loss={step.loss!r} is measured on one device: it calls the decoder and the "
                                   "head apart, around DDP's forward")
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (step.batch * step.grad_accum, step.seq), generator=gen).to(dev)

    def context():
        stack = contextlib.ExitStack()
        if not reference:
            stack.enter_context(_attention_context(impl))
            if impl.recompute == "selective":
                stack.enter_context(selective_recompute(model, impl.attention))
        return stack

    framework = step.loss in FRAMEWORK_LOSSES
    if framework and reference:
        raise UnsupportedError(f"loss={step.loss!r} is measured on Hugging Face models (as the tracer runs it)")
    from trainmem.trace.losses import HeldLogits
    return Workload(model=model, optimizer=optimizer, step=step, impl=impl, device=dev, ids=ids,
                    params=params, masters=masters, context=context,
                    ignore_labels=torch.full((step.batch, 1), -100, dtype=ids.dtype, device=dev) if framework else None,
                    held=HeldLogits() if framework else None)
