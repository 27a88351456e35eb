"""What ``optimizer.step()`` holds beyond its states: temporaries per (optimizer, implementation).

Each rule is a pure function of the tensors the optimizer updates (fp32 masters under a
master-weight recipe, else the parameters that train): their total and largest bytes. Rules
follow PyTorch 2.x ``torch/optim/adam.py`` and ``sgd.py`` (AdamW is Adam with
``decoupled_weight_decay``, so its weight decay is an in-place ``mul_``):

* foreach Adam/AdamW (``_multi_tensor_adam``): ``torch._foreach_sqrt(exp_avg_sqs)`` makes one
  temporary like every ``exp_avg_sq`` of a device/dtype group at once, then divides and adds in
  place: Σ numel·bytes.
* for-loop Adam/AdamW (``_single_tensor_adam``): ``(exp_avg_sq.sqrt() / bias_correction2_sqrt)``
  holds the square root and the quotient together, one tensor at a time: 2 × the largest tensor.
* fused (``_fused_adam`` -> ``torch._fused_adamw_``, ``_fused_sgd`` -> ``torch._fused_sgd_``):
  one kernel updates in place; nothing.
* SGD with or without momentum, any implementation (``_single_tensor_sgd``,
  ``_multi_tensor_sgd``): ``mul_``/``add_`` in place; nothing (no weight decay, no nesterov).
* RMSprop (``torch/optim/rmsprop.py``): foreach ``_foreach_sqrt(square_avgs)``, Σ numel·bytes;
  for-loop ``avg = square_avg.sqrt()`` while the previous tensor's ``avg`` is still bound.
* Adagrad (``adagrad.py``): foreach ``std = _foreach_sqrt(state_sums)`` and
  ``numerator = _foreach_mul(grads, minus_clr)``, both alive at ``_foreach_addcdiv_``: 2 Σ numel·bytes;
  for-loop ``std = state_sum.sqrt()`` while the previous ``std`` is still bound; fused
  (``torch._fused_adagrad_``) nothing.
* bitsandbytes (Adam, Lion, RMSprop; ``Optimizer2State``/``Optimizer1State.update_step``): one
  kernel per parameter updates it, its states and absmax in place; nothing.

Weight decay in torch's SGD, RMSprop and Adagrad (``grad = grad.add(param, alpha=wd)``, or
``_foreach_add``) makes a gradient-sized temporary, as do nesterov and ``maximize``: not modelled
(the readers refuse a weight decay for these optimizers; trainmem's own flags never set one).

With the optimizer in backward (torchtune's ``optimizer_in_bwd``) every parameter has its own
optimizer, so each rule applies to one tensor at a time.

Known limitations: one parameter group of one dtype (several groups -- HF Trainer's decay /
no-decay split -- step one group at a time, so foreach holds only the larger group's temporary);
Adafactor's rule is transformers' two temporaries of the largest tensor, not checked against
``torch.optim.Adafactor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from trainmem.estimate.state_items import BNB
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.optimizer_impl import DEFAULT_IMPL, IMPLEMENTATIONS, check_optimizer, optimizer_impl_used

__all__ = ["Stepped", "optimizer_impl_used", "check_optimizer", "step_temporaries", "in_backward_temporaries",
           "recipe_transient", "DEFAULT_IMPL"]

@dataclass(frozen=True)
class Stepped:
    """The tensors one ``optimizer.step()`` updates: their total bytes, and the bytes of each in
    the optimizer's order (``model.parameters()``); ``sizes`` may be a representative run -- two
    alike blocks stand for all of them -- enough for rules that look at neighbours or the largest."""

    total_bytes: int
    sizes: tuple[int, ...]
    elem_bytes: float  # of the stepped tensors (formulas only)

    @property
    def largest_bytes(self) -> int:
        return max(self.sizes, default=0)


Rule = Callable[[Stepped], tuple[int, str]]
_RULES: dict[tuple[str, str], Rule] = {}


def _rule(optimizers: tuple[str, ...], impls: tuple[str, ...]) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for key in ((o, i) for o in optimizers for i in impls):
            if key in _RULES:
                raise ValueError(f"duplicate optimizer-step rule for {key}")
            if key[1] not in IMPLEMENTATIONS.get(key[0], ()):
                raise ValueError(f"optimizer-step rule for {key}, an implementation specs/optimizer_impl.py lacks")
            _RULES[key] = fn
        return fn
    return register


@_rule(("adamw", "adam"), ("foreach",))
def _adam_foreach(s: Stepped) -> tuple[int, str]:
    return s.total_bytes, f"sqrt(exp_avg_sq) of every tensor at once (Σnumel·{s.elem_bytes:g})"


@_rule(("adamw", "adam"), ("for-loop",))
def _adam_for_loop(s: Stepped) -> tuple[int, str]:
    # ``denom`` of the previous tensor is still bound while the next one's sqrt and quotient exist
    pairs = [prev + 2 * cur for prev, cur in zip((0,) + s.sizes, s.sizes)]
    return max(pairs, default=0), (f"previous tensor's denom + sqrt(exp_avg_sq) and its quotient "
                                   f"(max over neighbours of numel₋₁·{s.elem_bytes:g} + 2·numel·{s.elem_bytes:g})")


def _neighbours(s: Stepped, what: str) -> tuple[int, str]:
    """A for-loop holding one temporary per tensor, the previous tensor's still bound by its name
    while the next one is made."""
    pairs = [prev + cur for prev, cur in zip((0,) + s.sizes, s.sizes)]
    return max(pairs, default=0), (f"previous tensor's {what} + this one's "
                                   f"(max over neighbours of numel₋₁·{s.elem_bytes:g} + numel·{s.elem_bytes:g})")


@_rule(("rmsprop",), ("foreach",))
def _rmsprop_foreach(s: Stepped) -> tuple[int, str]:
    return s.total_bytes, f"sqrt(square_avg) of every tensor at once (Σnumel·{s.elem_bytes:g})"


@_rule(("rmsprop",), ("for-loop",))
def _rmsprop_for_loop(s: Stepped) -> tuple[int, str]:
    return _neighbours(s, "avg = sqrt(square_avg)")


@_rule(("adagrad",), ("foreach",))
def _adagrad_foreach(s: Stepped) -> tuple[int, str]:
    return 2 * s.total_bytes, (f"std = sqrt(sum) and numerator = grad·(−clr) of every tensor at once "
                               f"(2·Σnumel·{s.elem_bytes:g})")


@_rule(("adagrad",), ("for-loop",))
def _adagrad_for_loop(s: Stepped) -> tuple[int, str]:
    return _neighbours(s, "std = sqrt(sum)")


@_rule(("adamw", "adam", "sgd", "sgd-momentum", "adagrad"), ("fused",))
def _fused(s: Stepped) -> tuple[int, str]:
    return 0, "fused kernel updates in place"


@_rule(("sgd", "sgd-momentum"), ("foreach", "for-loop"))
def _sgd(s: Stepped) -> tuple[int, str]:
    return 0, "in-place update"


@_rule(("adafactor",), ("foreach", "for-loop"))
def _adafactor(s: Stepped) -> tuple[int, str]:
    return 2 * s.largest_bytes, f"2 × largest tensor (max_numel·{2 * s.elem_bytes:g})"


@_rule(tuple(BNB), ("fused",))
def _bnb(s: Stepped) -> tuple[int, str]:
    # bitsandbytes/optim/optimizer.py, Optimizer2State/Optimizer1State.update_step: one kernel per
    # parameter (optimizer_update_8bit_blockwise / optimizer_update_32bit) updates p, states and absmax in place
    return 0, "bitsandbytes' kernel updates each tensor in place"


def _torchao_rule(block: int, fp32_copies: int, packed: float, index_bytes: int) -> Rule:
    """torchao 0.18 steps one parameter at a time through ``torch.compile(single_param_adam)``
    (``torchao/optim/adam.py``, ``_AdamBase.step``). For a quantized tensor inductor keeps, per state,
    an fp32 copy of it and its new block scales, and for 4-bit states the unpacked codes and int64
    indices of the code lookup. Read off inductor's generated code on CPU (``TORCH_LOGS=output_code``,
    torch 2.13): 8-bit ``2·n·4 + 2·n/256·4``; 4-bit ``2·n·1 + 2·n/128·4 + 2·n·4 + 2·n·8``; and measured
    to the byte in the real compiled step (tests/estimate/test_torchao_step_measured.py). CUDA's
    generated code may keep fewer; on CUDA the first call also benchmarks each kernel on clones of the
    arguments it writes (``CachingAutotuner.maybe_clone_args``), not modelled. A tensor torchao does not
    quantize runs as one fused kernel: nothing."""
    def rule(s: Stepped) -> tuple[int, str]:
        per = [int(n * (fp32_copies * 4 + packed + index_bytes)) + 2 * (n // block) * 4
               for n in (int(b / s.elem_bytes) for b in s.sizes) if n >= 4096 and n % block == 0]
        return max(per, default=0), (f"the largest quantized tensor's compiled-step buffers "
                                     f"(numel·{fp32_copies * 4 + packed + index_bytes:g} + 2·⌈numel/{block}⌉·4)")
    return rule


_rule(("torchao-adamw8bit",), ("fused",))(_torchao_rule(256, 2, 0, 0))
_rule(("torchao-adamw4bit",), ("fused",))(_torchao_rule(128, 2, 2, 16))
_rule(("torchao-adamw4bit-block256",), ("fused",))(_torchao_rule(256, 2, 2, 16))  # the same code, 256-value blocks


def step_temporaries(step: StepSpec, impl: ImplSpec, stepped: Stepped) -> tuple[int, str]:
    """Bytes alive inside ``optimizer.step()`` beyond gradients and states, and their rule."""
    check_optimizer(step, impl)
    used = optimizer_impl_used(step, impl)
    nbytes, why = _RULES[(step.optimizer, used)](stepped)
    return nbytes, f"{used}: {why}"


def in_backward_temporaries(step: StepSpec, impl: ImplSpec, stepped: Stepped) -> tuple[int, str]:
    """The same rule with one optimizer per parameter: the largest tensor's temporaries."""
    one = Stepped(stepped.largest_bytes, (stepped.largest_bytes,), stepped.elem_bytes)
    nbytes, why = step_temporaries(step, impl, one)
    return nbytes, f"{why}, one optimizer per parameter: the largest alone"


def recipe_transient(step: StepSpec, impl: ImplSpec, stepped: Stepped, grad_copy_bytes: int = 0) -> tuple[int, str]:
    """The optimizer's temporaries (:func:`step_temporaries`, or
    :func:`in_backward_temporaries` with the optimizer in backward) plus the fp32
    gradient copies a master-weight recipe makes for it (``grad_copy_bytes``, as large as the masters)."""
    rule = in_backward_temporaries if impl.optimizer_in_backward else step_temporaries
    extra, why = rule(step, impl, stepped)
    if grad_copy_bytes:
        return grad_copy_bytes + extra, f"fp32 gradient copies (numel·4) + {why}"
    return extra, why
