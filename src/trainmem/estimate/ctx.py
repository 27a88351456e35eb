"""Dtype policy and the kernel-level save rules shared by every block rule.

Each function here models what one PyTorch kernel (or a short composite) keeps
for backward. The docstring names the kernel whose saved set it follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from trainmem.errors import UnsupportedError
from trainmem.estimate.graph import Graph, Sym
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

__all__ = ["Ctx", "promote"]

_RANK = {"bool": 0, "int64": 0, "float16": 1, "bfloat16": 1, "float32": 2}


def promote(a: str, b: str) -> str:
    """Result dtype of a binary op between two float tensors (type promotion)."""
    if a == b:
        return a
    return a if _RANK[a] > _RANK[b] else b


@dataclass(frozen=True)
class Shard:
    """How one rank's block is cut: tensor (+ sequence) and context parallelism."""

    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_style: str = "ring"
    ep: int = 1

    def symbols(self) -> dict[str, str]:
        """The rank-local sizes as global symbols (``estimate/parallel_tp.py`` ``apply_tp``): heads,
        FFN widths and vocabulary divided by ``tp`` (experts' width only without expert
        parallelism), the sequence by ``cp``."""
        subs = {}
        if self.tp > 1:
            subs.update(A="A/tp", Akv="Akv/tp", F="F/tp", V="⌈V/tp⌉")
            if self.ep == 1:
                subs["Fe"] = "Fe/tp"
        if self.cp > 1:
            subs["S"] = "S/cp"
        return subs


@dataclass
class Ctx:
    """Everything a block rule needs: the graph, sizes, and the dtype policy."""

    graph: Graph
    model: ModelSpec
    step: StepSpec
    impl: ImplSpec
    trainable: Callable[[str], bool] = staticmethod(lambda name: True)
    """Whether the parameter with this (HF) name receives a gradient (fine-tuning freezes some)."""
    finetune_linear: Callable[..., Sym] | None = None
    """Fine-tuning's linear rule (frozen or 4-bit base, LoRA adapter; ``estimate/finetune.py``),
    called as ``finetune_linear(ctx, x, ...)`` in place of :meth:`plain_linear`."""
    replicate: bool = False
    """Identical blocks may be simulated once and repeated (:meth:`Graph.repeat`)."""
    shard: Shard = Shard()
    """This rank's cut of the block (``model`` is already the rank-local model: heads, FFN width
    and vocabulary divided by ``tp``; ``step.seq`` is the rank's ``S / cp``)."""
    kv_cache: bool = True
    """transformers' KV cache is on (``use_cache``): a training forward still builds a DynamicCache and
    attention reads K/V from its ``torch.cat`` copies. Gradient checkpointing turns it off
    (``GPT2Model.forward`` and the other ``*Model.forward``: ``if self.gradient_checkpointing and
    self.training: use_cache = False``), so a checkpointed block recomputes without it."""
    checkpointed: bool = False
    """The set a block recomputes under transformers' gradient checkpointing, which also makes a frozen token
    embedding's output require a gradient (``enable_input_require_grads``): block 0 recomputes what every block does."""

    def __post_init__(self) -> None:
        d = self.step.dtypes
        self.param = d.compute                    # dtype of weights as the kernels read them
        self.low = d.activation if d.autocast else None  # autocast's compute dtype
        self.B, self.S = self.step.batch, self.step.seq
        self.graph.subs = self.shard.symbols()

    # sequence parallelism -------------------------------------------------------
    def sp_scatter(self, x: Sym, label: str) -> Sym:
        """Enter a sequence-parallel region: this rank keeps S/tp of the tokens (a new tensor:
        reduce-scatter after a row-parallel linear, or a slice copy after the embedding)."""
        tp = self.shard.tp
        if not self.shard.sp or tp == 1:
            return x
        shape = x.shape[:1] + (x.shape[1] // tp,) + x.shape[2:]
        return self.graph.new(label, shape, x.dims[:1] + (f"{x.dims[1]}/tp",) + x.dims[2:], x.dtype, x.requires_grad)

    def sp_gather(self, x: Sym, label: str) -> Sym:
        """Leave a sequence-parallel region: all-gather the tokens (DTensor keeps the gathered
        tensor for the column-parallel linears that read it)."""
        tp = self.shard.tp
        if not self.shard.sp or tp == 1:
            return x
        shape = x.shape[:1] + (x.shape[1] * tp,) + x.shape[2:]
        seq = x.dims[1][:-len("/tp")] if x.dims[1].endswith("/tp") else f"{x.dims[1]}·tp"
        return self.graph.new(label, shape, x.dims[:1] + (seq,) + x.dims[2:], x.dtype, x.requires_grad)

    # kernels ---------------------------------------------------------------
    def cast(self, x: Sym, dtype: str, label: str) -> Sym:
        """``x.to(dtype)``: a new storage unless the dtype already matches (ToCopy saves nothing)."""
        if x.dtype == dtype:
            return x
        return self.graph.new(label, x.shape, x.dims, dtype, x.requires_grad)

    def weight_trainable(self, label: str = "weight") -> bool:
        return self.trainable(self.graph.path(label))

    def linear(self, x: Sym, out_features: int, out_sym: str, *, weight: tuple[int, int],
               label: str = "out", bias: bool = False) -> Sym:
        if self.finetune_linear is not None:
            if self.impl.recompute == "op":
                raise UnsupportedError("recompute='op' with fine-tuning adapters is not modelled: "
                                       "use none, selective, full or every-k")
            if self.impl.float8 != "none":
                raise UnsupportedError(f"float8={self.impl.float8!r} with fine-tuning adapters is not modelled")
            return self.finetune_linear(self, x, out_features, out_sym, weight=weight, label=label)
        return self.plain_linear(x, out_features, out_sym, weight=weight, label=label, bias=bias)

    def plain_linear(self, x: Sym, out_features: int, out_sym: str, *, weight: tuple[int, int],
                     label: str = "out", bias: bool = False) -> Sym:
        """``F.linear`` / ``addmm``: saves the input (and the weight, a parameter).

        ``out_sym`` is the output features' symbol; the weight is ``(out_sym, x.dims[-1])``.
        Under autocast the input and the weight are cast first; the casts are what
        mm's backward keeps, so the weight copy counts as an activation.
        The output comes from aten.addmm with a bias (contiguous 2-D/3-D input,
        aten/src/ATen/native/Linear.cpp ``linear``: ``_flatten_nd_linear``), else from aten.mm
        (``matmul`` folds the leading axes); an op-level checkpoint policy reads which.
        A linear torchao converts to ``Float8Linear`` keeps what ``estimate/float8.py`` says.
        """
        if self.impl.float8 != "none" and self.float8_converts(weight):
            from trainmem.estimate.float8 import float8_linear
            return float8_linear(self, x, out_features, out_sym, weight=weight, label=label, bias=bias)
        g = self.graph
        wt = self.weight_trainable()
        if self.low:
            xin = self.cast(x, self.low, "input_cast")
            g.save(g.new("weight_cast", weight, (out_sym, x.dims[-1]), self.low, wt), when=x.requires_grad)
            out_dtype = self.low
        else:
            xin, out_dtype = x, x.dtype
        g.save(xin, when=wt)  # mm keeps its input only for the weight's gradient
        return g.new(label, x.shape[:-1] + (out_features,), x.dims[:-1] + (out_sym,), out_dtype, x.requires_grad or wt,
                     op="addmm" if bias else "mm")

    def float8_converts(self, weight: tuple[int, int]) -> bool:
        """Whether torchao's conversion (torchtitan's filter) makes this linear a ``Float8Linear``."""
        from trainmem.estimate.float8 import converted
        return converted(self.model, self.graph.path("weight"), weight)

    def dropout(self, x: Sym, p: float, label: str = "dropout", *, module: bool = False) -> Sym:
        """``F.dropout`` in training. CUDA's fused ``native_dropout`` keeps a bool mask;
        the CPU path multiplies by a noise tensor in the input dtype (aten ``_dropout_impl``).
        ``module``: the dropout is an ``nn.Dropout`` submodule named ``label`` (names follow it)."""
        if p <= 0.0:
            return x
        g = self.graph
        mask_dtype = "bool" if self.impl.device == "cuda" else x.dtype
        if module:
            with g.module(label):
                g.save(g.new("mask", x.shape, x.dims, mask_dtype, False), when=x.requires_grad)
                return g.new("out", x.shape, x.dims, x.dtype, x.requires_grad)
        g.save(g.new(f"{label}_mask", x.shape, x.dims, mask_dtype, False), when=x.requires_grad)
        return g.new(label, x.shape, x.dims, x.dtype, x.requires_grad)

    def mul(self, a: Sym, b: Sym, label: str, *, shape=None, dims=None) -> Sym:
        """Elementwise product: each operand is kept for the other's gradient."""
        self.graph.save(a, when=b.requires_grad)
        self.graph.save(b, when=a.requires_grad)
        return self.graph.new(label, shape or a.shape, dims or a.dims, promote(a.dtype, b.dtype), a.requires_grad or b.requires_grad)

    def add(self, a: Sym, b: Sym, label: str) -> Sym:
        """Elementwise sum: keeps nothing."""
        return self.graph.new(label, a.shape, a.dims, promote(a.dtype, b.dtype), a.requires_grad or b.requires_grad)
