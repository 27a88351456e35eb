"""Which implementations each optimizer has, and which one ``optimizer.step()`` runs.

A fact about the step's spec, below both the estimator (``estimate/optimizer_step.py`` keeps one
temporaries rule per pair of this table, and refuses a rule for a pair the table lacks) and the
tracer (``trace/step.py`` builds the optimizer it names).
"""

from __future__ import annotations

from trainmem.errors import SpecError
from trainmem.specs import ImplSpec, StepSpec

__all__ = ["IMPLEMENTATIONS", "DEFAULT_IMPL", "optimizer_impl_used", "check_optimizer"]

IMPLEMENTATIONS: dict[str, tuple[str, ...]] = {
    "adamw": ("foreach", "for-loop", "fused"),
    "adam": ("foreach", "for-loop", "fused"),
    "sgd": ("fused", "foreach", "for-loop"),
    "sgd-momentum": ("fused", "foreach", "for-loop"),
    "adafactor": ("foreach", "for-loop"),  # torch.optim.Adafactor has no fused kernel
    "rmsprop": ("foreach", "for-loop"),  # torch/optim/rmsprop.py: no _fused_rmsprop
    "adagrad": ("foreach", "for-loop", "fused"),  # adagrad.py, _fused_adagrad (CPU and CUDA)
    # bitsandbytes (one CUDA kernel per parameter) and torchao (a compiled step per parameter)
    **dict.fromkeys(("adam8bit", "adamw8bit", "paged-adamw8bit", "paged-adamw32bit", "lion32bit", "lion8bit",
                     "paged-lion8bit", "paged-lion32bit", "rmsprop8bit", "rmsprop32bit", "ademamix", "ademamix8bit"),
                    ("fused",)),
    "torchao-adamw8bit": ("fused",),
    "torchao-adamw4bit": ("fused",),
    "torchao-adamw4bit-block256": ("fused",),
}
"""optimizer -> its implementations; the first is the one used when the device's default is not
among them (bitsandbytes' and torchao's single implementation)."""

DEFAULT_IMPL = {"cuda": "foreach", "cpu": "for-loop"}
"""torch's default when neither ``foreach`` nor ``fused`` is given (``torch/optim/optimizer.py``
``_default_to_fused_or_foreach``: foreach only on devices with foreach kernels, i.e. not CPU)."""


def optimizer_impl_used(step: StepSpec, impl: ImplSpec) -> str:
    """The implementation ``optimizer.step()`` runs: the one asked for, or torch's default on the
    device; an optimizer with a single implementation (bitsandbytes) has that one."""
    if impl.optimizer_impl != "auto":
        return impl.optimizer_impl
    have = IMPLEMENTATIONS[step.optimizer]
    default = DEFAULT_IMPL[impl.device]
    return default if default in have else have[0]


def check_optimizer(step: StepSpec, impl: ImplSpec) -> None:
    """SpecError unless the optimizer has the implementation and placement asked for."""
    used = optimizer_impl_used(step, impl)
    have = IMPLEMENTATIONS[step.optimizer]
    if used not in have:
        raise SpecError("optimizer_impl", used, f"{step.optimizer} has no such implementation (it has {', '.join(have)})")
    if not impl.optimizer_in_backward:
        return
    if step.grad_accum > 1:  # torchtune's recipes refuse it: the hook steps before accumulation ends
        raise SpecError("grad_accum", step.grad_accum, "must be 1 with optimizer_in_backward "
                                                        "(each parameter steps as soon as its gradient exists)")
    if step.dtypes.master:
        raise SpecError("precision", step.precision, "keeps fp32 master weights; optimizer_in_backward "
                                                     "steps the parameters themselves (use fp32, bf16 or amp-*)")
