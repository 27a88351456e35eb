"""Fine-tuning: which parameters train, what frozen and 4-bit layers keep, and LoRA adapters.

Three pieces plug into the estimator:

* :func:`trainable_predicate` -- ``Ctx.trainable``: every kernel rule already keeps an operand
  only when the gradient that needs it is required, so freezing is a predicate over HF names.
* :class:`FinetuneLinear` -- ``Ctx.finetune_linear``: the base linear (plain, or bitsandbytes'
  4-bit ``Linear4bit``) followed, at targeted modules, by peft's ``lora.Linear.forward``
  (peft 0.1x ``tuners/lora/layer.py``)::

      result = base_layer(x)
      x = x.to(lora_A.weight.dtype)                       # _cast_input_dtype
      result = result + lora_B(lora_A(dropout(x))) * scaling
      result = result.to(torch_result_dtype)

  ``lora_A`` keeps its input (the dropout output, or ``x`` itself when p = 0), ``lora_B`` keeps
  the rank-r intermediate, dropout keeps its mask only when ``x`` needs a gradient, the scaling
  (a Python float) and the add keep nothing. Under autocast each adapter matmul keeps its own
  low-precision input copy and weight copy. bitsandbytes' ``MatMul4Bit`` keeps only the packed
  weight (a parameter): neither the input nor a dequantized weight is saved.
  Frozen linears leave a zero-byte marker item (``<module>.input``, "not saved: frozen weight")
  so reports show what was *not* kept.
* :func:`finetune_state_items` -- model states: frozen parameters have no gradient, master
  weight or optimizer state; adapters ``<module>.lora_A.default.weight`` (r, in) and
  ``lora_B`` (out, r) have all three, in ``adapter_dtype``; a QLoRA base weight is stored as
  packed 4-bit codes plus its quantization constants (bitsandbytes ``quantize_4bit``).

Known limitations:
  - QLoRA is checked on CPU (bitsandbytes 0.50.2: storage and saved set exact); the CUDA
    kernels' workspaces are not measured. Non-quantized parameters
    (embeddings, norms, head) follow the step's precision; ``prepare_model_for_kbit_training``'s
    fp32 upcast of them is closest to ``precision=amp-bf16``.
  - Frozen MoE experts (fused ``grouped_mm``) still keep their routed inputs; LoRA on experts
    is not modelled.
  - peft's LoRA variants (DoRA, rsLoRA scaling aside) and ``modules_to_save`` are not modelled.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate.quant4bit_moments import COMPUTES_IN
from trainmem.estimate.ctx import Ctx
from trainmem.estimate.graph import Key, Sym
from trainmem.estimate.optimizer_step import Stepped
from trainmem.estimate.params import parameter_shapes
from trainmem.estimate.peak import Phase
from trainmem.estimate.quant4bit import quantized_weight_items
from trainmem.estimate.state_items import optimizer_state_items as _states
from trainmem.estimate.state_items import shared_state_items, state_item as _item
from trainmem.families import family_of
from trainmem.inventory import Category, MemoryItem, dtype_bytes
from trainmem.names import embedding_indices, is_token_embedding
from trainmem.specs import ModelSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec, trainable_by_name
from trainmem.specs.finetune import is_embedding_weight as _embedding_weight
from trainmem.specs.finetune import is_output_layer as _output_layer
from trainmem.specs.finetune import module_of as _module
from trainmem.specs.finetune import lora_targeted, quantized_module  # noqa: F401  (importers use these names here)

__all__ = [
    "trainable_predicate", "FinetuneLinear", "finetune_state_items", "finetune_optimizer_transient",
    "adapter_parameters", "dequant_transient", "head_dequant", "with_dequant_transient", "load_preset",
    "list_presets",
]

FROZEN_NOTE = "frozen: no gradient, master weight or optimizer state"


# which parameters train -------------------------------------------------------------------------

def trainable_predicate(model: ModelSpec, spec: FinetuneSpec) -> Callable[[str], bool]:
    """``name -> bool`` over HF parameter names (adapters: ``<module>.lora_A.default.weight``),
    :func:`trainmem.specs.finetune.trainable_by_name` over the spec's parameters."""
    names = [n for n, _ in parameter_shapes(model)] if spec.freeze or model.tied_embeddings else []
    return trainable_by_name(spec, names, tied_embeddings=model.tied_embeddings, model_name=model.name)


def is_linear_weight(model: ModelSpec, name: str, shape: tuple[int, ...]) -> bool:
    """A 2-D weight of a linear layer other than the output head (what peft's ``all-linear``
    adapts and bitsandbytes quantizes)."""
    return (name.endswith(".weight") and len(shape) == 2 and not _embedding_weight(name)
            and not _output_layer(_module(name)))


def is_quantized_weight(model: ModelSpec, name: str, shape: tuple[int, ...], spec: FinetuneSpec) -> bool:
    """A 2-D linear weight (the head included) that :func:`quantized_module` makes 4-bit."""
    module = _module(name)
    linear = is_linear_weight(model, name, shape) or (_output_layer(module) and len(shape) == 2)
    return linear and name.endswith(".weight") and quantized_module(module, spec)


def _linear_in_out(model: ModelSpec, shape: tuple[int, int]) -> tuple[int, int]:
    """(in, out) of a linear weight; GPT-2's ``Conv1D`` stores ``[in, out]``."""
    return (shape[0], shape[1]) if family_of(model).conv1d else (shape[1], shape[0])


def adapter_parameters(model: ModelSpec, spec: FinetuneSpec) -> list[tuple[str, tuple[int, int], str]]:
    """``(name, shape, after)``: each adapter weight and the base parameter it follows."""
    spec = spec.for_model(model)  # lora_targets None: the family's default
    out = []
    for name, shape in parameter_shapes(model):
        module = _module(name)
        # an untied output layer is adapted only when named (lora_targeted: never under all-linear):
        # peft's LoRA wraps lm_head as any Linear, LitGPT's lora_head=True makes it a LoRALinear
        # (litgpt/lora.py GPT.__init__); its adapters train like the others
        head = _output_layer(module) and name.endswith(".weight") and len(shape) == 2
        if (is_linear_weight(model, name, shape) or head) and lora_targeted(module, spec):
            fan_in, fan_out = _linear_in_out(model, shape)
            r = spec.lora_rank
            out.append((f"{module}.lora_A.default.weight", (r, fan_in), name))
            out.append((f"{module}.lora_B.default.weight", (fan_out, r), name))
    if spec.adapters and not out:
        raise UnsupportedError(
            f"lora_targets={list(spec.lora_targets)} match no linear layer of {model.name} ({model.family})")
    return out


def _adapter_dtype(spec: FinetuneSpec, step: StepSpec) -> str:
    return step.dtypes.param if spec.adapter_dtype == "param" else spec.adapter_dtype


# activations: the linear rule ---------------------------------------------------------------------

class FinetuneLinear:
    """``Ctx.finetune_linear``: a frozen or 4-bit base, then peft's adapter at targeted modules.

    Collects zero-byte marker items (``notes``) for inputs a frozen layer does not keep.
    """

    def __init__(self, model: ModelSpec, step: StepSpec, spec: FinetuneSpec) -> None:
        self.spec = spec
        self.adapter_dtype = _adapter_dtype(spec, step)
        self.notes: list[MemoryItem] = []
        self.held: dict[Key, Sym] = {}  # inputs bitsandbytes < 0.43.2 holds (estimate/bnb_legacy.py)

    def __call__(self, ctx: Ctx, x: Sym, out_features: int, out_sym: str, *, weight: tuple[int, int],
                 label: str = "out") -> Sym:
        g, spec = ctx.graph, self.spec
        module = ".".join(g.scope)
        trainable = ctx.weight_trainable()
        if quantized_module(module, spec):
            out = self._linear4bit(ctx, x, out_features, out_sym, weight=weight, label=label)
        else:
            out = ctx.plain_linear(x, out_features, out_sym, weight=weight, label=label)
            if not trainable:
                self._note(ctx, x, "frozen weight", "mm keeps its input only for the weight's gradient")
        if lora_targeted(module, spec):
            out = self._lora(ctx, x, out, weight)
        return out

    def _note(self, ctx: Ctx, x: Sym, what: str, why: str) -> None:
        """A zero-byte marker: this layer's input is not kept (shown in reports next to what is)."""
        dims, text = ctx.graph.render(x)
        item = MemoryItem(name=ctx.graph.path("input"), category=Category.ACTIVATION, shape=x.shape, dtype=x.dtype,
                          bytes=0, formula=f"not saved: {what} ({text})", note=f"not saved: {what}: {why}", dims=dims)
        self.notes.append(item)

    def _linear4bit(self, ctx: Ctx, x: Sym, out_features: int, out_sym: str, *, weight, label: str) -> Sym:
        """bitsandbytes ``Linear4bit.forward``: ``x.to(compute_dtype)``, ``MatMul4Bit`` (keeps only the
        packed weight; dequantizes one weight at a time as a temporary), result cast back to x's dtype."""
        a = ctx.cast(x, self.spec.compute_dtype, "input_cast")  # a temporary, not saved (bnb >= 0.43.2)
        if self.spec.quant_impl == "bnb-legacy":
            from trainmem.estimate.bnb_legacy import hold_input
            hold_input(ctx, a, self.held)
        else:
            self._note(ctx, x, f"4-bit {self.spec.quant_type} weight", "MatMul4Bit keeps only the packed weight; "
                       f"{COMPUTES_IN}{self.spec.compute_dtype}")  # read by quant4bit_moments.four_bit_markers
        return ctx.graph.new(label, x.shape[:-1] + (out_features,), x.dims[:-1] + (out_sym,), x.dtype, x.requires_grad)

    def _lora(self, ctx: Ctx, x: Sym, result: Sym, weight: tuple[int, int]) -> Sym:
        g, spec, r = ctx.graph, self.spec, self.spec.lora_rank
        out_f, in_f = weight
        out_sym = result.dims[-1]
        xa = ctx.cast(x, self.adapter_dtype, "lora_input_cast")  # peft _cast_input_dtype
        with g.module("lora_dropout.default"):
            d = ctx.dropout(xa, spec.lora_dropout, "out")
        with g.module("lora_A.default"):
            a = ctx.plain_linear(d, r, "r", weight=(r, in_f))
        with g.module("lora_B.default"):
            b = ctx.plain_linear(a, out_f, out_sym, weight=(out_f, r))
        scaled = g.new("lora_scaled", b.shape, b.dims, b.dtype, b.requires_grad)  # * scaling (a float): keeps nothing
        total = ctx.add(result, scaled, "lora_sum")
        return ctx.cast(total, result.dtype, "lora_out")  # result.to(torch_result_dtype)

    def embedding_notes(self, ctx: Ctx, model: ModelSpec) -> None:
        """Markers for frozen embedding tables: their indices are not kept."""
        for name, _ in parameter_shapes(model):
            if _embedding_weight(name) and not ctx.trainable(name):
                # token ids are (B, S); position and token-type ids one (1, S) row
                per_row = not is_token_embedding(name)
                ids = Sym("", *(((1, ctx.S), ("1", "S")) if per_row else ((ctx.B, ctx.S), ("B", "S"))), "int64")
                dims, text = ctx.graph.render(ids)
                self.notes.append(MemoryItem(
                    name=embedding_indices(_module(name)), category=Category.ACTIVATION, shape=ids.shape, dtype="int64",
                    bytes=0, formula=f"not saved: frozen embedding ({text})", dims=dims,
                    note="not saved: frozen embedding (the indices serve only the weight's gradient)"))


# model states ---------------------------------------------------------------------------------------

def quantized_items(name: str, shape: tuple[int, ...], spec: FinetuneSpec,
                    weight_dtype: str = "bfloat16") -> list[MemoryItem]:
    """A 4-bit base weight as ``spec.quant_impl`` stores it (:mod:`trainmem.estimate.quant4bit`)."""
    return quantized_weight_items(name, shape, spec, weight_dtype)


def finetune_state_items(model: ModelSpec, step: StepSpec, spec: FinetuneSpec) -> list[MemoryItem]:
    """Model states under fine-tuning, one item per parameter and ledger (see module docstring)."""

    d = step.dtypes
    pb, gb = dtype_bytes(d.param), dtype_bytes(d.grad)
    if spec.mode == "qlora" and spec.quantize_head and model.tied_embeddings:
        raise SpecError("quantize_head", True, f"{model.name}'s head is its input embedding (tied); only an "
                                               "untied head can be 4-bit")
    trainable = trainable_predicate(model, spec)
    adapters: dict[str, list[tuple[str, tuple[int, int]]]] = {}
    for name, shape, after in adapter_parameters(model, spec) if spec.adapters else ():
        adapters.setdefault(after, []).append((name, shape))
    train = step.mode == "train"
    out: list[MemoryItem] = []
    for name, shape in parameter_shapes(model):
        if is_quantized_weight(model, name, shape, spec):
            out += quantized_items(name, shape, spec, d.param)
        elif train and trainable(name):
            out.append(_item(name, Category.PARAMETER, shape, d.param, f"numel·{pb:g}"))
            out.append(_item(f"{name}.grad", Category.GRADIENT, shape, d.grad, f"numel·{gb:g}"))
            if d.master:
                out.append(_item(f"{name}.master", Category.MASTER_WEIGHT, shape, d.master, "numel·4"))
            out.extend(_states(name, shape, step))
        else:
            item = _item(name, Category.PARAMETER, shape, d.param, f"numel·{pb:g}")
            out.append(replace(item, note=FROZEN_NOTE) if train else item)
        for aname, ashape in adapters.get(name, ()):
            out += _adapter_items(aname, ashape, step, spec, train)
    return out + shared_state_items(step, out)


def _adapter_items(name: str, shape: tuple[int, int], step: StepSpec, spec: FinetuneSpec,
                   train: bool) -> list[MemoryItem]:
    """An adapter weight: grads like the weight; fp32 master and fp32 optimizer states only for a
    16-bit adapter under a master-weight recipe; otherwise states follow the weight (torch's AdamW
    keeps ``zeros_like(param)``)."""

    d = step.dtypes
    dt = _adapter_dtype(spec, step)
    b = dtype_bytes(dt)
    out = [_item(name, Category.PARAMETER, shape, dt, f"numel·{b:g}")]
    if not train:
        return out
    out.append(_item(f"{name}.grad", Category.GRADIENT, shape, dt, f"numel·{b:g}"))
    master = bool(d.master) and dt != "float32"
    if master:
        out.append(_item(f"{name}.master", Category.MASTER_WEIGHT, shape, "float32", "numel·4"))
    out.extend(_states(name, shape, step, d.state if master else dt))
    return out


def finetune_optimizer_transient(items: list[MemoryItem], step: StepSpec, impl=None) -> tuple[int, str]:
    """``optimizer_step_transient_bytes`` over the parameters that train: the tensors stepped are
    each trainable parameter's fp32 master when it has one, else the parameter itself."""
    from trainmem.estimate.optimizer_step import recipe_transient
    from trainmem.specs import ImplSpec

    by_name = {i.name: i for i in items}
    stepped = [by_name.get(f"{n}.master", by_name.get(n)) for n in
               (i.name.removesuffix(".grad") for i in items if i.category is Category.GRADIENT)]
    stepped = [i for i in stepped if i is not None]
    if not stepped:
        return 0, "nothing trains"
    big = max(stepped, key=lambda i: i.bytes)
    total = Stepped(sum(i.bytes for i in stepped), tuple(i.bytes for i in stepped), dtype_bytes(big.dtype))
    masters = sum(i.bytes for i in stepped if i.category is Category.MASTER_WEIGHT)
    extra, why = recipe_transient(step, impl or ImplSpec(), total, masters)
    return extra, f"{why} (trainable parameters)"


# QLoRA's dequantization temporaries -------------------------------------------------------------------

def dequant_transient(model: ModelSpec, spec: FinetuneSpec | None, compiled: bool = False,
                      weight_dtype: str | None = None) -> tuple[int, str]:
    """One dequantized base weight at a time, in the compute dtype, while a 4-bit matmul runs in a
    block (forward, and again for the input gradient in backward): the largest 4-bit block weight.
    Zero unless qlora. The output head's, when it is 4-bit, is :func:`head_dequant`. Eager torchao
    NF4 holds more (:func:`torchao_nf4_dequant_bytes`); ``compiled``: inductor fuses its pointwise
    ops, so at most the weight itself is made (a real inductor call on CPU showed only its output's
    storage; not checked at scale or on CUDA). ``weight_dtype``: the dtype the weights were quantized from (the
    step's parameter dtype); where it is not the compute dtype, bitsandbytes' ``MatMul4Bit.backward`` holds the
    weight dequantized to it and its copy in the compute dtype at once (estimate/quant4bit_moments.py)."""
    if spec is None or spec.mode != "qlora":
        return 0, ""
    sizes = [(math.prod(s), n) for n, s in parameter_shapes(model)
             if is_quantized_weight(model, n, s, spec) and not _output_layer(_module(n))]
    if not sizes:
        return 0, ""
    numel, name = max(sizes)
    b = dtype_bytes(spec.compute_dtype)
    if spec.quant_impl == "torchao-nf4" and not compiled:
        return torchao_nf4_dequant_bytes(numel, b, spec.quant_block), (
            f"dequantizing {name} (torchao NF4Tensor.get_original_weight: int64 codes 8·numel + "
            f"3·numel·{b:g} + scalers numel/{spec.quant_block}·{b:g})")
    if weight_dtype is not None and weight_dtype != spec.compute_dtype and spec.quant_impl in ("bnb", "bnb-legacy"):
        w = dtype_bytes(weight_dtype)
        return int(numel * (w + b)), (f"dequantized {name} (largest 4-bit weight) in {weight_dtype} and its "
                                      f"{spec.compute_dtype} copy, numel·({w:g} + {b:g})")
    return int(numel * b), f"dequantized {name} (largest 4-bit weight, numel·{b:g})"


def torchao_nf4_dequant_bytes(numel: int, b: float, block: int) -> int:
    """The working set of torchao's ``NF4Tensor.get_original_weight``
    (torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py), whose locals live until it
    returns: the two nibble halves widened to int64 (``.to(torch.long)``: 2·(numel/2)·8), their
    looked-up values and the scaled values (numel·b each), the block scalers (numel/block·b), and
    ``torch.stack``'s output, the weight itself (numel·b), made while all of them are alive."""
    return int(8 * numel + 3 * numel * b + numel // block * b)


def head_dequant(model: ModelSpec, step: StepSpec, spec: FinetuneSpec | None) -> tuple[int, int]:
    """(the 4-bit output head dequantized, the logits it makes): with ``quantize_head`` the head's
    weight in the compute dtype is alive while the logits (B·S·V in the logits' dtype) are made, and
    again while their gradient flows back into the hidden state; (0, 0) otherwise."""
    if spec is None or not spec.quantize_head:
        return 0, 0
    head = sum(int(math.prod(s) * dtype_bytes(spec.compute_dtype)) for n, s in parameter_shapes(model)
               if _output_layer(_module(n)) and is_quantized_weight(model, n, s, spec))
    d = step.dtypes
    logits = step.batch * step.seq * model.vocab_size * dtype_bytes(d.activation if d.autocast else d.compute)
    return head, int(logits) if head else 0


def with_dequant_transient(phases: list[Phase], nbytes: int, why: str, head_bytes: int = 0,
                           logits_bytes: int = 0, node_moments_hold_it: bool = False,
                           backward: tuple[int, str] | None = None) -> list[Phase]:
    """Add the dequantized weight to the phases that run a 4-bit matmul. Each block's backward
    holds the largest block weight's (``nbytes``). The end of forward and the loss backward run
    only the head: with a 4-bit head (``head_bytes``, :func:`head_dequant`) its matmul holds the
    dequantized head next to the logits or their gradient in the logits' dtype (``logits_bytes``),
    not next to the fp32 copies the phase counts, which come before or after it; with a 16-bit head
    the forward phase is at least the largest block matmul's moment (the activations so far, at most
    all of them, plus ``nbytes``). ``node_moments_hold_it``: the block's 4-bit matmul moments are node moments that
    count it (estimate/quant4bit_moments.py), so a backward phase at a node moment (``node_work``) gets nothing more:
    its other nodes (the MLP product's ``MulBackward0``, the RMSNorms') run no 4-bit matmul. ``backward``: what
    the blocks' backward matmuls hold instead (:func:`dequant_transient` with ``weight_dtype``: the weight
    dequantized to its own dtype and its compute-dtype copy), where the forward's ``gemm_4bit`` holds ``nbytes``."""
    if not nbytes and not head_bytes:
        return phases
    back, back_why = backward or (nbytes, why)
    out = []
    for p in phases:
        if p.name == "forward":
            add = (max(0, head_bytes + logits_bytes - p.parts.get("logits", 0)) if head_bytes
                   else max(0, nbytes - p.parts.get("logits", 0)))
        elif p.name == "backward_start":
            add = max(0, head_bytes + logits_bytes - p.parts.get("logits_grad", 0)) if head_bytes else 0
        elif p.name.startswith("backward") and p.name != "backward_end":
            add = 0 if node_moments_hold_it and "node_work" in p.parts else back
        else:
            add = 0
        if add:
            what = "the dequantized 4-bit head" if p.name in ("forward", "backward_start") and head_bytes else \
                back_why if p.name.startswith("backward") else why
            p = Phase(p.name, p.bytes + add, {**p.parts, "dequant_temporary": add}, f"{p.note}; + {what}")
        out.append(p)
    return out


# presets ---------------------------------------------------------------------------------------------------

def _preset_dir():
    from importlib.resources import files

    return files("trainmem") / "data" / "finetune"


def list_presets() -> list[str]:
    """Bundled fine-tuning recipes (``data/finetune/*.json``)."""
    return sorted(p.name.removesuffix(".json") for p in _preset_dir().iterdir() if p.name.endswith(".json"))


def load_preset(name: str, **overrides) -> FinetuneSpec:
    """A bundled recipe as a :class:`FinetuneSpec`; ``overrides`` replace its fields."""
    import json

    from trainmem.errors import ConfigError

    path = _preset_dir() / f"{name}.json"
    if not path.is_file():
        raise ConfigError(f"unknown fine-tuning preset {name!r}; bundled: {', '.join(list_presets())}")
    data = json.loads(path.read_text())
    data.pop("description", None)
    data.update(overrides)
    return FinetuneSpec.from_dict(data)
