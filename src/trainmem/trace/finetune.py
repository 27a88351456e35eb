"""Fine-tuning applied to the traced model: frozen parameters, peft LoRA adapters, QLoRA's 4-bit base.

``apply_finetune(model, spec, model_spec)`` does to the built Hugging Face model what a user's
script does before training:
  - ``full`` with ``freeze``: ``requires_grad_(False)`` on every parameter the patterns name,
    read by the estimator's own pattern reader (``trainmem.specs.finetune.trainable_by_name``:
    the same words mean the same parameters in both);
  - ``lora``: ``peft.get_peft_model`` with a ``LoraConfig`` of the spec's rank, alpha, targets and
    dropout (``fan_in_fan_out`` for GPT-2's Conv1D layers), which freezes the base and adds
    ``lora_A``/``lora_B`` to each targeted module. Under fake tensors the adapters are fake too.
    ``adapter_dtype``: float32 is peft's ``autocast_adapter_dtype=True`` (16-bit adapters upcast,
    peft/tuners/tuners_utils.py ``BaseTuner._cast_adapter_dtype``), ``param`` keeps the base's
    dtype (``autocast_adapter_dtype=False``), bfloat16/float16 cast the adapters afterwards.
  - ``qlora``: the linears the spec quantizes become bitsandbytes' ``Linear4bit`` or torchao NF4
    linears first (:mod:`trainmem.trace.qlora`: the libraries' own quantization on fake tensors),
    then the adapters are added as for ``lora``.

Known limitations:
  - ``--quant-impl bnb-legacy`` is refused (:func:`trainmem.trace.qlora.check_quant`).
  - ``--recompute op`` with adapters is refused, as the estimator refuses it.
"""

from __future__ import annotations

import contextlib
import warnings

from trainmem.errors import SpecError, UnsupportedError
from trainmem.specs.finetune import FinetuneSpec

__all__ = ["apply_finetune", "check_finetune"]


def check_finetune(spec: FinetuneSpec | None, *, recompute: str = "none", real: bool = False) -> None:
    """Refuse, before anything is built, what the tracer cannot run."""
    if spec is None:
        return
    if spec.mode == "qlora":
        from trainmem.trace.qlora import check_quant
        check_quant(spec)
    if spec.adapters and recompute == "op":
        raise UnsupportedError("--recompute op with LoRA adapters is not modelled; use --recompute full")


def apply_finetune(model, spec: FinetuneSpec | None, model_spec=None):
    """The model to train: ``model`` with frozen parameters, or its peft wrapper with adapters."""
    if spec is None:
        return model
    check_finetune(spec)
    if not spec.adapters:
        if model_spec is None:
            raise UnsupportedError("--freeze needs a model trainmem reads (a preset or a config.json of a supported type)")
        from trainmem.specs.finetune import trainable_by_name
        names = [n for n, _ in model.named_parameters()]  # the estimate's names (a tied head is its embedding)
        trainable = trainable_by_name(spec, names, tied_embeddings=model_spec.tied_embeddings,
                                      model_name=model_spec.name)  # refuses a pattern that matches nothing
        for name, p in model.named_parameters():
            p.requires_grad_(trainable(name))
        return model
    if spec.mode == "qlora":  # the 4-bit base first, as transformers loads it before peft wraps it
        from trainmem.trace.qlora import quantize_base
        for p in model.parameters():
            p.requires_grad_(False)
        quantize_base(model, spec)
    return _lora(model, spec)


def _lora(model, spec: FinetuneSpec):
    try:
        import peft
    except ImportError:  # pragma: no cover
        raise UnsupportedError("--finetune lora needs peft: pip install peft") from None
    import torch
    from transformers.pytorch_utils import Conv1D

    # None (no model spec to take the family's default from): peft's own default for the model_type
    # (LoraModel._prepare_adapter_config, TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)
    targets = (None if spec.lora_targets is None
               else "all-linear" if "all-linear" in spec.lora_targets else list(spec.lora_targets))
    conv1d = any(isinstance(m, Conv1D) for m in model.modules())  # GPT-2 stores weights (in, out)
    config = peft.LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha, target_modules=targets,
                             lora_dropout=spec.lora_dropout, fan_in_fan_out=conv1d)
    try:
        with _fake_safe_module_to(model), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers' deprecated is_gradient_checkpointing
            wrapped = peft.get_peft_model(model, config, autocast_adapter_dtype=spec.adapter_dtype == "float32")
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise SpecError("lora_targets", ",".join(spec.lora_targets or ()), str(exc).splitlines()[0][:200]) from None
    if spec.adapter_dtype in ("bfloat16", "float16"):
        dtype = getattr(torch, spec.adapter_dtype)
        for name, p in wrapped.named_parameters():
            if ".lora_" in name:
                p.data = p.data.to(dtype)
    return wrapped


@contextlib.contextmanager
def _fake_safe_module_to(model):
    """peft moves each new adapter to its base layer's device and dtype with ``Module.to``
    (peft/tuners/tuners_utils.py ``BaseTunerLayer._move_adapter_to_device_of_base_layer``,
    peft/tuners/lora/model.py ``LoraModel._replace_module``), and ``Module._apply`` swaps
    FakeTensor parameters with ``torch.utils.swap_tensors``, which refuses a tensor with a weak
    reference, as every fake tensor made under the mode has (torch/nn/modules/module.py ``_apply``).
    While peft builds the adapters on a fake model, ``Module.to`` casts by re-assigning new
    parameters, as peft's own ``cast_adapter_dtype`` does; every fake tensor is on the CPU already."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    if not any(is_fake(p) for p in model.parameters()):
        yield
        return
    original = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        for owner in self.modules():
            for name, p in list(owner.named_parameters(recurse=False)):
                if device is not None and p.device != device:
                    raise UnsupportedError(f"fine-tuning moves {name} to {device}; the trace runs on the CPU")
                if dtype is not None and p.is_floating_point() and p.dtype != dtype:
                    setattr(owner, name, torch.nn.Parameter(p.data.to(dtype), requires_grad=p.requires_grad))
            for name, b in list(owner.named_buffers(recurse=False)):
                if dtype is not None and b.is_floating_point() and b.dtype != dtype:
                    owner._buffers[name] = b.to(dtype)
        return self

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original
