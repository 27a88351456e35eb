"""torchtune's ``optimizer:`` section -> ``--optimizer`` (and ``--optimizer-impl``).

torchtune's recipes build the optimizer with ``config.instantiate(cfg_optimizer, params)``
(``recipes/full_finetune_single_device.py`` and ``lora_finetune_single_device.py``,
``_setup_optimizer``): the class at ``_component_``, every other key one of its keywords. A key
changes memory as that keyword does in that class, and the class is named as
``integrations/read.py`` names a live one (``OPTIMIZER_CLASSES``, ``optimizer_key``):

* ``torch.optim`` ``AdamW``, ``Adam``, ``SGD`` (``momentum`` -> a momentum buffer), ``RMSprop``,
  ``Adagrad``; ``fused``/``foreach`` pick the implementation. SGD's, RMSprop's and Adagrad's
  weight decay, nesterov, maximize and RMSprop's momentum/centered are refused by
  ``check_torch_settings``, as for a TrainingArguments ``optim``; Adam's ``amsgrad``
  (``adam.py`` ``_init_group``: a ``max_exp_avg_sq`` per parameter) and ``maximize``
  (``_multi_tensor_adam``: ``torch._foreach_neg(grads)``) here.
* ``bitsandbytes.optim`` (0.50): the class, ``optim_bits`` (a class without a bit suffix) and
  ``is_paged`` (``Adam``, ``AdamW``, ``Lion``, ``AdEMAMix``; the ``Paged*`` classes set it) say
  what runs; ``min_8bit_size`` other than 4096 (which tensors get 8-bit states) is refused.
* ``torchao.optim`` (``torchao.prototype.low_bit_optim`` before 0.11) ``AdamW8bit``/``AdamW4bit``
  with ``block_size``; ``amsgrad`` and ``bf16_stochastic_round`` are refused.

Any other ``_component_`` is a ConfigError naming it, never an AdamW estimate.
"""

from __future__ import annotations

from trainmem.errors import ConfigError, UnsupportedError

__all__ = ["read_optimizer"]

_TORCH = ("torch.optim.",)
_BNB = ("bitsandbytes.optim.",)
_TORCHAO = ("torchao.optim.", "torchao.prototype.low_bit_optim.")
_TORCH_CLASSES = ("AdamW", "Adam", "SGD", "RMSprop", "Adagrad")
#: keyword -> what it adds that trainmem does not model
_TORCHAO_UNMODELLED = {"amsgrad": "a max_exp_avg_sq state per parameter",
                       # quant_utils.py _fp32_to_bf16_sr: torch.randint int32 bits per value, inside the compiled step
                       "bf16_stochastic_round": "random int32 bits per value in its compiled step"}
#: bitsandbytes classes whose constructor takes ``is_paged`` (optim/adam.py, adamw.py, lion.py, ademamix.py)
_BNB_PAGEABLE = ("Adam", "AdamW", "Lion", "AdEMAMix")
_BNB_MIN_8BIT = 4096  # Optimizer8bit's min_8bit_size default, the threshold estimate/state_items.py lays out
_MODELLED = ("torch.optim AdamW, Adam, SGD, RMSprop, Adagrad; bitsandbytes.optim Adam8bit, AdamW8bit, "
             "PagedAdamW8bit, PagedAdamW(32bit), Lion(8bit|32bit), PagedLion(8bit|32bit), RMSprop(8bit|32bit), "
             "AdEMAMix(8bit); torchao.optim AdamW8bit, AdamW4bit")


def read_optimizer(get, section, step: dict, impl: dict, where: str) -> None:
    """``step["optimizer"]`` (and ``impl["optimizer_impl"]``) from the ``optimizer`` section, or a
    ConfigError naming ``optimizer._component_`` or the keyword that is not modelled."""
    component = get("_component_", str, "optimizer")
    if component is None:
        return
    prefix, _, cls = component.rpartition(".")
    prefix += "."
    what = f"optimizer._component_={component!r}"
    if prefix in _TORCH and cls in _TORCH_CLASSES:
        step["optimizer"] = _torch(get, section, cls, what, where)
        # torch/optim/adamw.py, AdamW(fused=..., foreach=...): fused wins; neither is torch's default
        if get("fused", bool, "optimizer"):
            impl["optimizer_impl"] = "fused"
        elif (foreach := get("foreach", bool, "optimizer")) is not None:
            impl["optimizer_impl"] = "foreach" if foreach else "for-loop"
        return
    if prefix in _BNB:
        step["optimizer"] = _bitsandbytes(get, cls, what, where)
        return
    if prefix in _TORCHAO:
        step["optimizer"] = _torchao(get, cls, what, where)
        return
    raise ConfigError(f"{where}: {what} is not modelled (modelled: {_MODELLED})")


def _refuse_set(get, where: str, what: str, cls: str, unmodelled: dict[str, str]) -> None:
    for key, adds in unmodelled.items():
        if value := get(key, None, "optimizer"):
            raise ConfigError(f"{where}: {what} with optimizer.{key}={value!r}: {cls} then holds {adds}, "
                              "which trainmem does not model")


def _torch(get, section: dict, cls: str, what: str, where: str) -> str:
    from trainmem.integrations.read import OPTIMIZER_CLASSES, check_torch_settings

    try:  # weight decay, nesterov, maximize, RMSprop's momentum/centered, Adam's amsgrad (as hf_args' optim does)
        check_torch_settings(cls, section, what)
    except UnsupportedError as e:
        raise ConfigError(f"{where}: {e}") from None
    if cls == "SGD":  # a momentum buffer per parameter
        return "sgd-momentum" if get("momentum", (int, float), "optimizer") else "sgd"
    return OPTIMIZER_CLASSES[cls][0]


def _bitsandbytes(get, cls: str, what: str, where: str) -> str:
    """The class named by what it runs, as ``integrations.read.optimizer_key`` names a live one:
    ``bitsandbytes.{Paged}{stem}{8|32}bit``."""
    from trainmem.integrations.read import OPTIMIZER_CLASSES

    if cls == "AdEMAMix32bit":  # optim/ademamix.py: an Optimizer2State, Adam's layout
        raise ConfigError(f"{where}: {what} is not modelled: an Optimizer2State with Adam's layout, not "
                          "AdEMAMix's two momenta (bitsandbytes.optim.AdEMAMix is modelled)")
    paged = cls.startswith("Paged")
    stem = cls.removeprefix("Paged")
    bits = 8 if stem.endswith("8bit") else 32 if stem.endswith("32bit") else None
    stem = stem.removesuffix("8bit").removesuffix("32bit")
    if bits is None:  # Lion, RMSprop, AdamW, AdEMAMix...: optim_bits=32 by default
        bits = get("optim_bits", int, "optimizer") or 32
    if not paged and stem in _BNB_PAGEABLE:
        paged = bool(get("is_paged", bool, "optimizer"))
    if (min8 := get("min_8bit_size", int, "optimizer")) not in (None, _BNB_MIN_8BIT):
        raise ConfigError(f"{where}: {what} with optimizer.min_8bit_size={min8}: only bitsandbytes' default "
                          f"{_BNB_MIN_8BIT} (which tensors keep 8-bit states) is modelled")
    key = f"bitsandbytes.{'Paged' if paged else ''}{stem}{bits}bit"
    if key not in OPTIMIZER_CLASSES:
        raise ConfigError(f"{where}: {what} (optim_bits={bits}, is_paged={paged}) is not modelled "
                          f"(modelled: {_MODELLED})")
    return OPTIMIZER_CLASSES[key][0]


def _torchao(get, cls: str, what: str, where: str) -> str:
    """``torchao.{cls}``, with a ``block_size`` other than the class's default in the name, as
    ``integrations.read.optimizer_key`` names a live one."""
    from trainmem.estimate.state_items import TORCHAO
    from trainmem.integrations.read import OPTIMIZER_CLASSES

    base = f"torchao.{cls}"
    if base not in OPTIMIZER_CLASSES:
        raise ConfigError(f"{where}: {what} is not modelled (modelled: {_MODELLED})")
    _refuse_set(get, where, what, f"torchao's {cls}", _TORCHAO_UNMODELLED)
    default = TORCHAO[OPTIMIZER_CLASSES[base][0]][0]  # adam.py: AdamW8bit block_size=256, AdamW4bit 128
    block = get("block_size", int, "optimizer")
    key = base if block in (None, default) else f"{base}(block_size={block})"
    if key not in OPTIMIZER_CLASSES:
        raise ConfigError(f"{where}: {what} with optimizer.block_size={block} is not modelled "
                          f"(torchao's default {default}" + (", or 256 for AdamW4bit)" if cls == "AdamW4bit" else ")"))
    return OPTIMIZER_CLASSES[key][0]
