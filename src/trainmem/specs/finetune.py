"""FinetuneSpec: which parameters train, and how (full fine-tuning, LoRA, QLoRA).

Defaults follow the libraries people run: peft's ``LoraConfig`` (r=8, alpha=8, no dropout,
adapters upcast to fp32 by ``get_peft_model(autocast_adapter_dtype=True)``) and the QLoRA
recipe of Dettmers et al. 2023 as configured through transformers' ``BitsAndBytesConfig``
(NF4, blocks of 64, double quantization, bf16 compute).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Callable, Literal, Sequence

from trainmem.errors import SpecError
from trainmem.families import family_of, layer_containers, output_layers
from trainmem.names import is_embedding, layer_index
from trainmem import validate as v

__all__ = ["FinetuneSpec", "MODES", "ADAPTER_DTYPES", "parse_layer_range", "trainable_by_name"]

MODES = ("full", "lora", "qlora")
ADAPTER_DTYPES = ("float32", "param", "bfloat16", "float16")
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
QUANT_TYPES = ("nf4", "fp4")
QLORA_SCOPES = ("all", "targeted")
QUANT_IMPLS = ("bnb", "bnb-legacy", "torchao-nf4")

_NAME = re.compile(r"^[A-Za-z0-9_.\-*]+$")


def parse_layer_range(pattern: str) -> range | None:
    """``layers.0-11`` -> range(0, 12); ``layers.5`` -> range(5, 6); anything else -> None.
    Any family's block container names a range (``h.0-3`` for GPT-2, ``layer.2`` for BERT)."""
    alt = "|".join(map(re.escape, layer_containers()))
    m = re.match(rf"^(?:{alt})\.(\d+)(?:-(\d+))?$", pattern)
    if not m:
        return None
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if hi < lo:
        raise SpecError("freeze", pattern, f"layer range runs backwards ({lo} > {hi})")
    return range(lo, hi + 1)


@dataclass(frozen=True, kw_only=True)
class FinetuneSpec:
    """Fine-tuning: frozen parts, LoRA adapters, a 4-bit base."""

    mode: Literal["full", "lora", "qlora"] = "full"
    """full (every parameter not frozen trains), lora (base frozen, low-rank adapters train),
    qlora (LoRA on a 4-bit quantized base)."""
    freeze: tuple[str, ...] = ()
    """Frozen parameters: ``embeddings`` (token/position tables), a block range ``layers.0-11``,
    or a module name / prefix (``lm_head``, ``model.norm``, ``self_attn``). Under lora/qlora the
    whole base is frozen already."""
    lora_rank: int = 8
    """Adapter rank r (peft ``r``)."""
    lora_alpha: float = 8
    """peft ``lora_alpha``; the adapter output is scaled by alpha / r (a Python float: keeps nothing)."""
    lora_targets: tuple[str, ...] | None = None
    """Module names that get adapters, matched like peft's ``target_modules`` (exact name or
    ``.name`` suffix); ``all-linear`` means every linear layer except the output head. None: the
    model family's default, peft's per-model ``target_modules`` (``Family.lora_targets``:
    ``q_proj, v_proj`` for Llama-style families, ``c_attn`` for GPT-2, ``query, value`` for BERT);
    :meth:`for_model` fills it in."""
    lora_dropout: float = 0.0
    """Dropout on the adapter input (peft ``lora_dropout``); > 0 keeps a mask and a copy of the input."""
    adapter_dtype: str = "float32"
    """Adapter weights' dtype: float32 (peft's default upcast of 16-bit adapters), or ``param``
    (same as the base parameters, ``autocast_adapter_dtype=False``), bfloat16, float16."""
    quant_type: str = "nf4"
    """4-bit data type of the QLoRA base (``bnb_4bit_quant_type``): nf4 or fp4 (same storage)."""
    quant_block: int = 64
    """Weights per quantization block; one absmax constant each (bitsandbytes blocksize)."""
    double_quant: bool = True
    """Quantize the absmax constants to 8 bits in blocks of ``double_quant_block``
    (``bnb_4bit_use_double_quant``)."""
    double_quant_block: int = 256
    """absmax constants per block of the second quantization (one fp32 constant each)."""
    compute_dtype: str = "bfloat16"
    """dtype a 4-bit weight is dequantized to for each matmul (``bnb_4bit_compute_dtype``)."""
    qlora_scope: str = "all"
    """Which linears are 4-bit: ``all`` but the output head (transformers' bitsandbytes integration,
    torchtune >= 0.3), or only the adapter-targeted ones (``targeted``: torchtune <= 0.2's
    ``LoRALinear(quantize_base=True)``, before FrozenNF4Linear)."""
    quantize_head: bool = False
    """The output head is 4-bit too (bitsandbytes ``llm_int8_skip_modules=[]``); untied heads only."""
    quant_impl: str = "bnb"
    """Storage of a 4-bit weight: ``bnb`` (bitsandbytes Params4bit) or ``torchao-nf4`` (torchao
    NF4Tensor, what torchtune uses: int8 block scalers, constants in the weight's dtype);
    ``bnb-legacy`` stores like ``bnb`` but its ``MatMul4Bit`` (bitsandbytes < 0.43.2) holds each
    4-bit linear's input until the graph is freed (:mod:`trainmem.estimate.bnb_legacy`)."""

    def __post_init__(self) -> None:
        v.one_of("mode", self.mode, MODES)
        for name in ("freeze", "lora_targets"):
            value = getattr(self, name)
            if value is None and name == "lora_targets":  # the family's default, filled in by for_model
                continue
            if isinstance(value, str):
                raise SpecError(name, value, "must be a list of names, not one string")
            object.__setattr__(self, name, tuple(value))
            for item in getattr(self, name):
                if not isinstance(item, str) or not _NAME.match(item):
                    raise SpecError(name, item, "must be a module name, prefix or layer range such as layers.0-11")
        for pattern in self.freeze:
            parse_layer_range(pattern)
        v.positive("lora_rank", self.lora_rank, maximum=1 << 16)
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float)) or self.lora_alpha <= 0:
            raise SpecError("lora_alpha", self.lora_alpha, "must be a positive number")
        if self.lora_targets is not None and not self.lora_targets:
            raise SpecError("lora_targets", self.lora_targets, "must name at least one module (or all-linear)")
        v.probability("lora_dropout", self.lora_dropout)
        v.one_of("adapter_dtype", self.adapter_dtype, ADAPTER_DTYPES)
        v.one_of("quant_type", self.quant_type, QUANT_TYPES)
        v.positive("quant_block", self.quant_block, maximum=1 << 16)
        v.boolean("double_quant", self.double_quant)
        v.positive("double_quant_block", self.double_quant_block, maximum=1 << 16)
        v.one_of("compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        v.one_of("qlora_scope", self.qlora_scope, QLORA_SCOPES)
        v.boolean("quantize_head", self.quantize_head)
        v.one_of("quant_impl", self.quant_impl, QUANT_IMPLS)
        if self.quant_impl == "torchao-nf4":
            if not self.double_quant:
                raise SpecError("double_quant", False, "torchao's NF4Tensor always quantizes its scalers (double "
                                                      "quantization); use quant_impl bnb for single quantization")
            if self.quant_type != "nf4":
                raise SpecError("quant_type", self.quant_type, "torchao-nf4 stores nf4 only")

    @property
    def adapters(self) -> bool:
        return self.mode in ("lora", "qlora")

    def for_model(self, model) -> "FinetuneSpec":
        """This spec with ``lora_targets`` filled in from ``model``'s family (peft's default
        ``target_modules`` for its ``model_type``) when left None; ``model`` None: unchanged."""
        if self.lora_targets is not None or model is None:
            return self
        return replace(self, lora_targets=family_of(model).lora_targets)

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.lora_rank

    def to_dict(self) -> dict:
        """Every field that matters for the mode (LoRA fields only with adapters, 4-bit fields only for qlora)."""
        lora = {f.name for f in fields(self) if f.name.startswith(("lora_", "adapter_"))}
        quant = {"quant_type", "quant_block", "double_quant", "double_quant_block", "compute_dtype", "qlora_scope",
                 "quantize_head", "quant_impl"}
        out = {}
        for f in fields(self):
            if (f.name in lora and not self.adapters) or (f.name in quant and self.mode != "qlora"):
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "FinetuneSpec":
        """A spec from a preset or JSON ``inputs["finetune"]``; unknown keys are errors."""
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise SpecError(key, data[key], f"unknown fine-tuning field; known: {', '.join(sorted(known))}")
        return cls(**{k: tuple(val) if isinstance(val, list) else val for k, val in data.items()})


# which parameters train: the spec's meaning over parameter names, below the estimator (which
# reads the names off the spec's model) and the tracer (which reads them off the built model) --

ADAPTER_MARKERS = (".lora_A.", ".lora_B.")


def module_of(param: str) -> str:
    return param.rpartition(".")[0]


def is_embedding_weight(name: str) -> bool:
    """An input embedding table (token, position, token-type) of any family."""
    return name.endswith(".weight") and is_embedding(module_of(name))


def is_output_layer(module: str) -> bool:
    """A family's output layer (``lm_head``, ``cls.predictions.decoder``): never adapted, never quantized."""
    return module in output_layers()


def lora_targeted(module: str, spec: FinetuneSpec) -> bool:
    """peft ``check_target_module_exists``: the module name, or a ``.name`` suffix of it."""
    if not spec.adapters or any(a.strip(".") in module.split(".") for a in ADAPTER_MARKERS):
        return False
    if "all-linear" in spec.lora_targets:
        return not is_output_layer(module)
    return any(module == t or module.endswith("." + t) for t in spec.lora_targets)


def quantized_module(module: str, spec: FinetuneSpec) -> bool:
    """The module's base weight is 4-bit: under qlora, every linear but the output head
    (``qlora_scope='all'``: transformers' bitsandbytes integration, torchtune >= 0.3) or only the
    adapter-targeted ones (``targeted``: torchtune <= 0.2); the head only with ``quantize_head``.
    Here, not in estimate/finetune.py, so the tracer (trace/qlora.py) picks the same linears
    without importing the estimator."""
    if spec.mode != "qlora":
        return False
    if is_output_layer(module):
        return spec.quantize_head
    return spec.qlora_scope == "all" or lora_targeted(module, spec)


def matches_freeze(name: str, pattern: str) -> bool:
    """A freeze pattern: ``embeddings``, a layer range, or a module name / dotted prefix."""
    if pattern == "embeddings":
        return is_embedding_weight(name)
    layers = parse_layer_range(pattern)
    if layers is not None:
        li = layer_index(name)
        return li is not None and li in layers
    return name == pattern or name.startswith(pattern + ".") or f".{pattern}." in f".{name}"


def trainable_by_name(spec: FinetuneSpec, names: Sequence[str], *, tied_embeddings: bool,
                      model_name: str) -> Callable[[str], bool]:
    """``name -> bool`` over HF parameter names (adapters: ``<module>.lora_A.default.weight``);
    ``names``: the model's parameters, which every freeze pattern must match (a pattern that
    freezes nothing is a typo, not a no-op) and whose first embedding is a tied head's tensor."""
    tied = next((n for n in names if is_embedding_weight(n)), None) if tied_embeddings else None
    for p in spec.freeze:
        if not any(matches_freeze(n, p) for n in names):
            raise SpecError("freeze", p, f"matches no parameter of {model_name} "
                                         "(use embeddings, layers.A-B or a module name such as model.layers.0)")

    def trainable(name: str) -> bool:
        if any(a in name for a in ADAPTER_MARKERS):
            return spec.adapters
        if spec.adapters:
            return False  # peft freezes the whole base (bias="none")
        if tied and is_output_layer(module_of(name)):
            name = tied  # one tensor: frozen together
        return not any(matches_freeze(name, p) for p in spec.freeze)

    return trainable
