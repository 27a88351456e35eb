"""What is alive at the loss's forward though no backward node saved it (the ``forward`` phase's extras).

The forward phase's top is inside the loss (aten ``nll_loss_forward``, its output and total weight just
made). Besides the saved set, the logits and their fp32 copy (``estimate/peak.py``), four kinds of tensors
are alive there that autograd does not keep, and that are gone before backward starts:

* ``kv_cache_unsaved``: transformers builds a ``DynamicCache`` in a training forward too (``use_cache``
  defaults to True; only gradient checkpointing turns it off, ``*Model.forward``), and each layer's
  ``DynamicLayer.update`` (``transformers/cache_utils.py``) keeps the ``torch.cat`` copies of K and V that
  attention reads. The model output holds the cache (``past_key_values``) until the caller drops it with
  the output, after the loss. Where attention saves those copies they are activations already; where it
  saves others (under autocast the SDPA kernel saves bf16 casts of an fp32 rotated K: GPT-NeoX, Llama; GPT-2's
  eager path keeps a transposed K and repeated V) the cache's own copies are extra. Which copies the rules
  make, and whether they are saved, is read off the rules themselves: :class:`_CacheProbe` runs the model's
  forward rule and records every ``k_cache`` / ``v_cache`` tensor it makes.
* ``autocast_bias_cache``, ``autocast_unsaved_casts``: autocast caches the low-precision copy of every leaf
  fp32 tensor that requires grad (``aten/src/ATen/autocast_mode.cpp`` ``cached_cast``) until the outermost
  autocast region exits (``torch.clear_autocast_cache()``, after the loss). A linear's weight copy is saved by
  its mm when its input requires grad; its bias copy never (``addmm``'s backward reads no operand for the
  bias), so each trainable linear bias's copy is extra (GPT-NeoX, GPT-2, Qwen2's q/k/v biases), and so is a
  trainable weight's copy where the input needs no gradient (block 0's LoRA ``lora_A`` behind a frozen
  embedding). A frozen weight is not cached (it does not require grad).
* ``head_input_unsaved``: under autocast the LM head saves a cast of the final norm's output; the output
  itself, in the weights' dtype (LayerNorm runs in fp32 under autocast; Llama's RMSNorm returns
  ``weight * x.to(input_dtype)``) stays bound (``outputs`` / ``hidden_states`` in ``*ForCausalLM.forward``)
  while ``self.loss_function`` runs (``estimate/autocast_cache.py`` ``autocast_head_input`` named Llama's).
* ``padded_labels``: ``ForCausalLMLoss`` (``transformers/loss/loss_utils.py``) pads the labels to (B, S+1)
  int64 and keeps ``labels[..., 1:].contiguous()`` as nll_loss's target; from B = 2 on that is a copy
  (``rules_hf_parts._target_shape``), and the padded storage stays bound in the function's frame until the
  loss returns.

Where checked: ``tests/estimate/test_eager_moments_forward.py`` (estimate == a CPU fake-tensor trace's
forward top, tiny GPT-NeoX, GPT-2, Llama, Qwen2; fp32, bf16, amp-bf16; LoRA amp-bf16:
``tests/estimate/test_eager_moments_lora.py``). Not modelled: compile, activation offload, the parallel
layouts (estimate/parallel.py builds its own phases), the reference/megatron profiles, families the hf rules
do not cover under --profile traced, and LitGPT (no
DynamicCache, other losses): those return nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainmem.estimate.ctx import Ctx
from trainmem.estimate.graph import Graph, Key, Sym
from trainmem.families import family_of
from trainmem.inventory import Category, Inventory, dtype_bytes
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

__all__ = ["forward_held", "kv_cache_unsaved", "autocast_unsaved_casts", "autocast_bias_cache", "head_input_unsaved",
           "padded_labels", "cast_linears"]

_CACHE_COPIES = ("k_cache", "v_cache")  # the rules' names of the DynamicCache's cat copies (rules_hf.py)


@dataclass(eq=False)
class _Probe(Graph):
    """A graph that also records, outside checkpoints (there the cache is off, and a checkpointed block's
    casts are ``estimate/autocast_cache.py``'s), the KV-cache copies the forward rule makes and autocast's
    copies of trainable weights, and counts a repeated block's once per block it stands for."""

    made: dict[str, dict[Key, Sym]] = field(default_factory=lambda: {"kv": {}, "casts": {}})
    copies: dict[str, int] = field(default_factory=lambda: {"kv": 0, "casts": 0})  # repeated blocks' bytes
    linears: set[str] = field(default_factory=set)  # every linear that casts its trainable weight
    #: fine-tuning: a checkpointed block's casts of trainable weights too (autocast_cache.py reads every weight_cast,
    #: frozen ones included, so the forward phase leaves fine-tuning to this probe, which sees ``requires_grad``)
    checkpointed_casts: bool = False

    def new(self, label: str, *args, **kwargs) -> Sym:
        t = super().new(label, *args, **kwargs)
        if label == "weight_cast" and t.requires_grad:
            self.linears.add(t.name.removesuffix(".weight_cast"))
        kind = "kv" if label in _CACHE_COPIES else "casts" if label == "weight_cast" and t.requires_grad else None
        if kind and (not self._checkpoint or (kind == "casts" and self.checkpointed_casts)):
            self.made[kind][self.key(t)] = t
        return t

    def repeat(self, template, prefix: str, src: int, dsts) -> None:
        super().repeat(template, prefix, src, dsts)
        own = f"{prefix}{src}."
        for kind in self.copies:
            self.copies[kind] += len(dsts) * sum(t.nbytes for t in self.unsaved(kind) if t.name.startswith(own))

    def unsaved(self, kind: str) -> list[Sym]:
        """The recorded tensors no node saved. bmm reads a V copy that is already (B, A, S, hd) and contiguous
        as it is (``repeat_kv`` returns its input when ``n_rep == 1``), which the rules name ``v_repeat``
        (``estimate/attention.py`` ``attention_core``): one of the same scope, bytes and dtype is this copy."""
        same = {(t.name.rpartition(".")[0], t.nbytes, t.dtype) for t in self.saved.values()
                if t.name.endswith(".v_repeat")}
        return [t for k, t in self.made[kind].items() if k not in self.saved and not (
                t.name.endswith(".v_cache") and (t.name.rpartition(".")[0], t.nbytes, t.dtype) in same)]

    def total(self, kind: str) -> int:
        return self.copies[kind] + sum(t.nbytes for t in self.unsaved(kind))


def _probe(model: ModelSpec, step: StepSpec, impl: ImplSpec, finetune=None) -> _Probe:
    """The model's forward rule run on a :class:`_Probe` (with fine-tuning's frozen weights and adapters, as
    ``estimate/activations.py`` ``activation_items_with_savers`` sets them up)."""
    from trainmem.estimate.rules_hf import hf_forward

    g = _Probe(checkpointed_casts=finetune is not None)
    ctx = Ctx(g, model, step, impl, replicate=finetune is None)
    if finetune is not None:
        from trainmem.estimate.finetune import FinetuneLinear, trainable_predicate
        finetune = finetune.for_model(model)
        ctx.trainable, ctx.finetune_linear = trainable_predicate(model, finetune), FinetuneLinear(model, step, finetune)
    hf_forward(ctx)
    return g


def cast_linears(model: ModelSpec, step: StepSpec, impl: ImplSpec, finetune=None) -> set[str]:
    """Every linear that casts its trainable weight under autocast (and so its bias: :func:`autocast_bias_cache`)."""
    return _probe(model, step, impl, finetune).linears


def kv_cache_unsaved(probe: _Probe) -> int:
    """Bytes of the DynamicCache's K/V copies no backward node saved."""
    return probe.total("kv")


def autocast_unsaved_casts(probe: _Probe) -> int:
    """Bytes of autocast's cached copies of trainable weights that no node saved: a linear saves its weight
    copy only for its input's gradient (``when=x.requires_grad``), so block 0's LoRA ``lora_A`` copies behind a
    frozen embedding are cached, not saved."""
    return probe.total("casts")


def autocast_bias_cache(states: Inventory, linears: set[str], low: str) -> int:
    """Bytes of the cached low-precision copies of the trainable linear biases: every linear that casts its
    trainable weight (``linears``, the probe's) casts its bias too."""
    grads = {i.name.removesuffix(".grad") for i in states if i.category is Category.GRADIENT}
    return sum(i.bytes // dtype_bytes(i.dtype) * dtype_bytes(low) for i in states
               if i.category is Category.PARAMETER and i.name in grads and i.name.endswith(".bias")
               and i.name.removesuffix(".bias") in linears)


def head_input_unsaved(model: ModelSpec, step: StepSpec) -> int:
    """The final hidden state (B, S, H) in the weights' dtype under autocast, which the LM head never saves
    (it saves its bf16 cast, or nothing when frozen)."""
    return step.batch * step.seq * model.hidden_size * dtype_bytes(step.dtypes.compute)


def padded_labels(B: int, S: int) -> int:
    """ForCausalLMLoss's padded (B, S+1) int64 labels, beside the copy nll_loss keeps (none at B = 1)."""
    return B * (S + 1) * 8 if B > 1 else 0


def _traced_output_held(model, step, impl) -> int:
    from trainmem.estimate.traced import traced_output_held
    return traced_output_held(model, step, impl)


def _encoder_held(model: ModelSpec, step: StepSpec, impl: ImplSpec, states: Inventory, finetune) -> dict[str, int]:
    """BERT's extras at its loss: the last LayerNorm's output its head does not save (``estimate/heads.py``
    ``classifier_forward_held``; the MLM transform's dense saves it, under autocast a bf16 cast of it, while
    ``BertForMaskedLM.forward``'s ``outputs`` binds the fp32 output to the loss), and under autocast the cached bias
    copies of every linear (an encoder has no KV cache in training)."""
    from trainmem.estimate.heads import classifier_forward_held
    d = step.dtypes
    out = {"head_input_unsaved": classifier_forward_held(model, step) if model.head != "mlm" else
           step.batch * step.seq * model.hidden_size * 4 if d.autocast else 0}
    if d.autocast:
        linears = _probe(model, step, impl, finetune).linears
        if "cls.predictions.decoder" in linears:  # its bias is the head's own parameter (BertLMPredictionHead: tied)
            linears = linears | {"cls.predictions"}
        out["autocast_bias_cache"] = autocast_bias_cache(states, linears, d.activation)
    return {k: v for k, v in out.items() if v}


def forward_held(model: ModelSpec, step: StepSpec, impl: ImplSpec, states: Inventory, finetune=None) -> dict[str, int]:
    """The forward phase's extras (the module docstring), for an HF causal LM under the hf profile (or the traced
    one, read with the hf rules where the family has them), eager, one device without offload (the caller's
    conditions). ``states``: the model states (which biases are trainable); ``finetune``: a FinetuneSpec or None."""
    if model.arch == "encoder" and impl.framework == "hf" and not impl.compile and impl.profile == "hf":
        return _encoder_held(model, step, impl, states, finetune)
    if impl.framework != "hf" or impl.compile or model.head not in ("lm", "seq-cls", "token-cls") or \
            model.arch != "decoder" or \
            impl.profile not in ("hf", "traced") or family_of(model).rules.forward == "traced":
        return {}
    # --profile traced: the same model's tensors, read with the hf rules where the family has them; the cache's
    # unsaved bytes read off the trace itself (traced/record.py _output_held: MiniMax's linear-attention state)
    traced, impl = impl if impl.profile == "traced" else None, replace(impl, profile="hf")
    d = step.dtypes
    out = {}
    if impl.recompute == "none" or d.autocast:  # checkpointing turns the cache off (*Model.forward)
        probe = _probe(model, step, impl, finetune)
        out["kv_cache_unsaved"] = 0 if impl.recompute != "none" else kv_cache_unsaved(probe) if traced is None else \
            _traced_output_held(model, step, traced)
        if d.autocast:
            out["autocast_unsaved_casts"] = autocast_unsaved_casts(probe)
            out["autocast_bias_cache"] = autocast_bias_cache(states, probe.linears, d.activation)
            if model.head == "lm":
                out["head_input_unsaved"] = head_input_unsaved(model, step)
    if model.head != "lm":  # a classifier: its held hidden states (estimate/heads.py); labels.view(-1), no padding
        from trainmem.estimate.heads import classifier_forward_held
        out["head_input_unsaved"] = classifier_forward_held(model, step)
    elif step.loss == "ce":
        out["padded_labels"] = padded_labels(step.batch, step.seq)
    return {k: v for k, v in out.items() if v}
