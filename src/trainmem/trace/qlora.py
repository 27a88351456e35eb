"""QLoRA's 4-bit base in the tracer: bitsandbytes' or torchao's own quantization, on fake or real tensors.

``quantize_base(model, spec)`` swaps each linear that the estimator makes 4-bit
(``trainmem.specs.finetune.quantized_module``, the estimator's: every linear but the head under ``qlora_scope=all``,
the adapter targets under ``targeted``, the head with ``quantize_head``) for a 4-bit one, then peft
adds the adapters as for LoRA (:mod:`trainmem.trace.finetune`):

* ``bnb``: bitsandbytes' ``Linear4bit`` (what transformers' ``replace_with_bnb_linear`` builds). Its
  weight is quantized by bitsandbytes' own ``Params4bit._quantize`` (bitsandbytes/nn/modules.py),
  which calls ``functional.quantize_4bit`` and, with double quantization, ``quantize_blockwise``:
  ``torch.ops.bitsandbytes.quantize_4bit`` / ``quantize_blockwise`` have fake kernels
  (bitsandbytes/_ops.py), so the packed codes and every constant are fake tensors of the real
  shapes. The forward is bitsandbytes' ``Linear4bit.forward`` -> ``matmul_4bit`` -> ``MatMul4Bit``
  (``dequantize_4bit`` has a fake kernel too). Two things cannot be the real objects on fake tensors,
  and are stood in for:

  - ``Params4bit`` itself: ``Params4bit.__new__`` calls ``torch.Tensor._make_subclass(cls, data)``,
    which refuses a FakeTensor ("Creating a new Tensor subclass Params4bit but the raw Tensor object
    is already associated to a python object of type FakeTensor", torch 2.13 / bitsandbytes 0.50.2).
    On fake tensors the weight is a fake ``nn.Parameter`` carrying ``Params4bit``'s attributes
    (``blocksize``, ``compress_statistics``, ``quant_type``, ``quant_storage``, ``quant_state``,
    ``bnb_quantized``, ``module``) and quantized by the same unbound ``Params4bit._quantize``; with
    ``real=True`` it is a genuine ``Params4bit``.
  - The 8-bit dynamic map of double quantization: ``quantize_blockwise`` builds it once with
    ``create_dynamic_map``, which calls ``.tolist()`` (no values on fake tensors), and caches it
    in ``functional.name2qmap``. It is built with fake tensors off and a fake copy sits in the
    cache while the base is quantized (the cache is restored afterwards).

* ``torchao-nf4``: torchao's ``to_nf4`` (``NF4Tensor.from_tensor``) runs on fake tensors as is; the
  linear is torchtune's ``FrozenNF4Linear`` (torchtune/modules/low_precision/nf4_linear.py: an
  ``nn.Linear`` whose frozen weight is ``to_nf4(weight)`` and whose forward is
  ``linear_nf4(input, weight)`` plus the bias), rebuilt here because torchtune 0.6 imports
  ``torchao.dtypes.nf4tensor``, which torchao 0.18 no longer has, and its ``swap_tensors`` refuses
  fake parameters.

``quantized_parts(t)`` names the storages a 4-bit weight holds, as the estimator's items do
(:mod:`trainmem.estimate.quant4bit`), so the recorder counts them as parameters.

Known limitations:
  - ``bnb-legacy`` (bitsandbytes < 0.43.2's ``MatMul4Bit``) is not what the installed
    bitsandbytes runs, and bitsandbytes quantizes the absmax in blocks of 256 only: both refused.
  - Temporaries an op makes and frees inside itself are not seen (as for every op): torchao's
    dequantization runs inside ``NF4Tensor.__torch_dispatch__``, so only its bf16 output is recorded.
  - peft wraps the 4-bit linear in its generic ``lora.Linear``, as for a model not marked
    ``is_loaded_in_4bit`` (the estimator's reference, tests/finetune/test_qlora_bnb.py); a model
    loaded by transformers with a ``BitsAndBytesConfig`` gets peft's ``lora.bnb.Linear4bit``,
    whose forward also clones the base output (a transient, never saved).
"""

from __future__ import annotations

import contextlib
import functools
import sys

from trainmem.errors import UnsupportedError

__all__ = ["quantize_base", "quantized_parts"]

# estimate/quant4bit.py's item suffixes for each storage of a 4-bit weight
_NF4_PARTS = (("", "quantized_data"), (".quantized_scalers", "quantized_scalers"),
              (".quantization_factor", "quantization_factor"), (".scaler_mean", "scaler_mean"), (".nf4", "nf4"))


def check_quant(spec) -> None:
    """Refuse what the installed libraries do not run (see Known limitations)."""
    if spec.quant_impl == "bnb-legacy":
        raise UnsupportedError("--quant-impl bnb-legacy cannot be traced: it models bitsandbytes < 0.43.2's "
                               "MatMul4Bit, which is not the installed one; use estimate")
    if spec.quant_impl == "bnb" and spec.double_quant and spec.double_quant_block != 256:
        raise UnsupportedError(f"--double-quant-block {spec.double_quant_block} cannot be traced: bitsandbytes' "
                               "quantize_4bit quantizes the absmax in blocks of 256 only")


def quantized_parts(t) -> list[tuple[str, object]] | None:
    """``[(name suffix, tensor), ...]``: the storages of a 4-bit weight (a bitsandbytes weight with a
    ``quant_state``, or a torchao ``NF4Tensor``), named as the estimator names them; None otherwise."""
    qs = getattr(t, "quant_state", None)
    if qs is not None and getattr(t, "bnb_quantized", False):
        parts = [("", t), (".absmax", qs.absmax)]
        if qs.state2 is not None:  # double quantization (bitsandbytes/functional.py quantize_4bit)
            parts += [(".absmax2", qs.state2.absmax), (".absmax_offset", qs.offset),
                      (".absmax_code", qs.state2.code)]
        return parts + [(".quant_code", qs.code)]
    nf4 = sys.modules.get("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    if nf4 is not None and isinstance(t, nf4.NF4Tensor):
        return [(suffix, getattr(t, attr)) for suffix, attr in _NF4_PARTS]
    return None


def quantize_base(model, spec) -> list[str]:
    """Make 4-bit, in place, the linears of ``model`` that ``spec`` quantizes; their names."""
    import torch
    from trainmem.specs.finetune import quantized_module

    check_quant(spec)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and quantized_module(n, spec)]
    make = _bnb_linear if spec.quant_impl == "bnb" else _nf4_linear
    with _fake_dynamic_map() if spec.quant_impl == "bnb" else contextlib.nullcontext():
        for name in names:
            parent, _, attr = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, attr, make(getattr(owner, attr), spec))
    return names


def _bnb():
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise UnsupportedError("--finetune qlora is traced with bitsandbytes' own 4-bit layers: "
                               "pip install bitsandbytes") from None
    return bnb


@contextlib.contextmanager
def _fake_dynamic_map():
    """bitsandbytes' cached 8-bit dynamic map as a fake tensor while fake tensors are on (see above)."""
    import torch
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

    functional = _bnb().functional
    if not is_fake(torch.empty(0)):
        yield
        return
    cache = functional.name2qmap
    before = cache.get("dynamic")
    with unset_fake_temporarily():
        values = functional.create_dynamic_map().tolist()
    cache["dynamic"] = torch.tensor(values, dtype=torch.float32)
    try:
        yield
    finally:
        if before is None:
            cache.pop("dynamic", None)
        else:
            cache["dynamic"] = before


def _bnb_linear(child, spec):
    """bitsandbytes' ``Linear4bit`` holding ``child``'s weight quantized by ``Params4bit._quantize``."""
    import torch
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

    bnb = _bnb()
    with unset_fake_temporarily():  # its own Params4bit(weight) cannot wrap a fake tensor: made on meta, replaced
        q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False, device="meta",
                              compute_dtype=getattr(torch, spec.compute_dtype),
                              compress_statistics=spec.double_quant, quant_type=spec.quant_type)
    attrs = dict(blocksize=spec.quant_block, compress_statistics=spec.double_quant, quant_type=spec.quant_type,
                 quant_storage=torch.uint8, module=q)
    w = child.weight.detach()
    if is_fake(w):
        weight = torch.nn.Parameter(w, requires_grad=False)  # a fake tensor flagged _is_param
        for k, v in {**attrs, "quant_state": None, "bnb_quantized": False}.items():
            setattr(weight, k, v)
    else:
        weight = bnb.nn.Params4bit(w, requires_grad=False, **attrs)
    bnb.nn.Params4bit._quantize(weight, "cpu")
    q.weight = weight
    q.bias = None if child.bias is None else torch.nn.Parameter(child.bias.detach(), requires_grad=False)
    return q


@functools.lru_cache(maxsize=None)
def _nf4_class():
    """torchtune's ``FrozenNF4Linear`` (torchtune/modules/low_precision/nf4_linear.py): its forward."""
    import torch
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

    class FrozenNF4Linear(torch.nn.Linear):
        def forward(self, input):
            out = linear_nf4(input=input, weight=self.weight)  # saves the NF4 weight, not the input
            return out if self.bias is None else out + self.bias

    return FrozenNF4Linear


def _nf4_linear(child, spec):
    """A frozen linear whose weight is torchao's ``to_nf4(child.weight)``."""
    import torch
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        raise UnsupportedError("--quant-impl torchao-nf4 is traced with torchao's NF4Tensor: "
                               "pip install torchao") from None
    cls = _nf4_class()
    q = cls.__new__(cls)
    torch.nn.Module.__init__(q)
    q.in_features, q.out_features = child.in_features, child.out_features
    nf4 = to_nf4(child.weight.detach(), block_size=spec.quant_block, scaler_block_size=spec.double_quant_block)
    q.weight = torch.nn.Parameter(nf4, requires_grad=False)
    q.bias = None if child.bias is None else torch.nn.Parameter(child.bias.detach(), requires_grad=False)
    return q
