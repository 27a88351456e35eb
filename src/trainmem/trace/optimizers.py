"""The optimizer a traced or measured step runs: torch's, bitsandbytes' or torchao's, in the
implementation ``impl.optimizer_impl`` names, with fp32 master copies under mixed precision, or
stepped per parameter inside backward (torchtune's ``optimizer_in_bwd``)."""

from __future__ import annotations

from trainmem.errors import UnsupportedError
from trainmem.specs import ImplSpec, StepSpec
from trainmem.trace.torch_state import torch_dtype

__all__ = ["make_optimizer_for", "OptimizerInBackward"]


_IMPL_KWARGS = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}


def _make_optimizer(name: str, params, impl: str = "foreach"):
    import torch
    kw = _IMPL_KWARGS[impl]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, **kw)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4, **kw)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-4, **kw)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-4, momentum=0.9, **kw)
    if name == "adafactor" and hasattr(torch.optim, "Adafactor"):
        return torch.optim.Adafactor(params, lr=1e-2, **kw)
    if name == "rmsprop":  # as transformers' _get_rmsprop builds it: no momentum, not centered
        return torch.optim.RMSprop(params, lr=1e-4, **kw)
    if name == "adagrad":  # _get_adagrad; makes its `sum` states here, not at the first step
        return torch.optim.Adagrad(params, lr=1e-4, **kw)
    from trainmem.trace import low_bit_optim as low
    if name in low.BNB_CLASSES:  # their one implementation: no foreach/fused keywords
        return low.make_bnb_optimizer(name, params)
    if name == "torchao-adamw4bit-block256":
        raise UnsupportedError(f"optimizer={name!r} is estimated, not traced: the tracer builds torchao's "
                               "AdamW4bit with its own 128-value block (trace/torchao_optim.py)")
    if name in low.TORCHAO_CLASSES:  # its compiled step, buffers seen (trace/torchao_optim.py)
        return low.make_torchao_optimizer(name, params)
    raise UnsupportedError(f"optimizer {name!r} cannot be traced on CPU (no CPU implementation in torch)")


class OptimizerInBackward:
    """torchtune's ``optimizer_in_bwd`` (``torchtune/training/_memory.py``
    ``register_optim_in_bwd_hooks``): one optimizer per parameter, stepped and zeroed in that
    parameter's post-accumulate-grad hook, so each gradient is freed as soon as it is used.
    ``step()`` and ``zero_grad()`` do nothing: the work happened during backward.
    ``param_groups`` and ``state`` are those of every per-parameter optimizer."""

    def __init__(self, params, make) -> None:
        self.optimizers = [make([p]) for p in params]
        for p, opt in zip(params, self.optimizers):
            p.register_post_accumulate_grad_hook(self._hook(opt))

    @staticmethod
    def _hook(opt):
        def step(_param) -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    @property
    def param_groups(self) -> list:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def make_optimizer_for(model, step: StepSpec, impl: ImplSpec | None = None):
    """``(trainable params, fp32 master copies or None, optimizer)`` as the step's precision and
    ``impl`` ask: mixed precision steps an fp32 master copy of each 16-bit parameter; the
    optimizer runs ``impl.optimizer_impl`` (auto: torch's default on ``impl.device``), in
    backward when ``impl.optimizer_in_backward`` (an :class:`OptimizerInBackward`)."""
    from functools import partial

    from trainmem.specs.optimizer_impl import check_optimizer, optimizer_impl_used

    impl = impl or ImplSpec()
    check_optimizer(step, impl)
    make = partial(_make_optimizer, step.optimizer, impl=optimizer_impl_used(step, impl))
    params = [p for p in model.parameters() if p.requires_grad]
    master = step.dtypes.master
    if impl.optimizer_in_backward:  # check_optimizer refused master weights
        return params, None, OptimizerInBackward(params, make)
    if master is None:
        return params, None, make(params)
    masters = [p.detach().to(torch_dtype(master)).requires_grad_(True) for p in params]
    return params, masters, make(masters)
