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
* ``autocast_bias_cache``: autocast caches the low-precision copy of every leaf fp32 tensor that requires
  grad (``aten/src/ATen/autocast_mode.cpp`` ``cached_cast``) until the outermost autocast region exits
  (``torch.clear_autocast_cache()``, after the loss). A linear's weight copy is saved by its mm anyway; its
  bias copy is not (``addmm``'s backward reads no operand for the bias), so each trainable linear bias's
  copy is extra (GPT-NeoX, GPT-2, Qwen2's q/k/v biases).
* ``head_input_unsaved``: under autocast the LM head saves a cast of the final norm's output; the output
  itself, in the weights' dtype (LayerNorm runs in fp32 under autocast; Llama's RMSNorm returns
  ``weight * x.to(input_dtype)``) stays bound (``outputs`` / ``hidden_states`` in ``*ForCausalLM.forward``)
  while ``self.loss_function`` runs (``estimate/autocast_cache.py`` ``autocast_head_input`` named Llama's).
* ``padded_labels``: ``ForCausalLMLoss`` (``transformers/loss/loss_utils.py``) pads the labels to (B, S+1)
  int64 and keeps ``labels[..., 1:].contiguous()`` as nll_loss's target; from B = 2 on that is a copy
  (``rules_hf_parts._target_shape``), and the padded storage stays bound in the function's frame until the
  loss returns.

Where checked: ``tests/estimate/test_eager_moments_forward.py`` (estimate == a CPU fake-tensor trace's
forward top, tiny GPT-NeoX, GPT-2, Llama, Qwen2; fp32, bf16, amp-bf16). Not modelled: fine-tuning (frozen
weights are not cached; LoRA adapters are), compile, activation offload, the traced/reference/megatron
profiles and LitGPT (no DynamicCache, other losses): those return nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainmem.estimate.ctx import Ctx
from trainmem.estimate.graph import Graph, Key, Sym
from trainmem.inventory import Category, Inventory, dtype_bytes
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

__all__ = ["forward_held", "kv_cache_unsaved", "autocast_bias_cache", "head_input_unsaved", "padded_labels"]

_CACHE_COPIES = ("k_cache", "v_cache")  # the rules' names of the DynamicCache's cat copies (rules_hf.py)


@dataclass(eq=False)
class _CacheProbe(Graph):
    """A graph that also records the KV-cache copies the forward rule makes (outside checkpoints: there the
    cache is off), and counts a repeated block's copies once per block it stands for."""

    cache: dict[Key, Sym] = field(default_factory=dict)
    copies: int = 0  # bytes of the cache copies of repeated blocks (Graph.repeat)

    def new(self, label: str, *args, **kwargs) -> Sym:
        t = super().new(label, *args, **kwargs)
        if label in _CACHE_COPIES and not self._checkpoint:
            self.cache[self.key(t)] = t
        return t

    def repeat(self, template, prefix: str, src: int, dsts) -> None:
        super().repeat(template, prefix, src, dsts)
        own = f"{prefix}{src}."
        self.copies += len(dsts) * sum(t.nbytes for t in self.unsaved() if t.name.startswith(own))

    def unsaved(self) -> list[Sym]:
        """The cache copies no node saved. bmm reads a V copy that is already (B, A, S, hd) and contiguous
        as it is (``repeat_kv`` returns its input when ``n_rep == 1``), which the rules name ``v_repeat``
        (``estimate/attention.py`` ``attention_core``): one of the same scope, bytes and dtype is this copy."""
        same = {(t.name.rpartition(".")[0], t.nbytes, t.dtype) for t in self.saved.values()
                if t.name.endswith(".v_repeat")}
        return [t for k, t in self.cache.items() if k not in self.saved and not (
                t.name.endswith(".v_cache") and (t.name.rpartition(".")[0], t.nbytes, t.dtype) in same)]


def kv_cache_unsaved(model: ModelSpec, step: StepSpec, impl: ImplSpec) -> int:
    """Bytes of the DynamicCache's K/V copies no backward node saved (0 when checkpointing turns it off)."""
    if impl.recompute != "none":
        return 0
    from trainmem.estimate.rules_hf import hf_forward

    g = _CacheProbe()
    hf_forward(Ctx(g, model, step, impl, replicate=True))
    return g.copies + sum(t.nbytes for t in g.unsaved())


def autocast_bias_cache(states: Inventory, casts: Inventory, low: str) -> int:
    """Bytes of the cached low-precision copies of the trainable linear biases: every linear that casts its
    weight (``X.weight_cast`` in ``casts``, the saved set without checkpointing) casts its bias too."""
    linears = {i.name.removesuffix(".weight_cast") for i in casts if i.name.endswith(".weight_cast")}
    grads = {i.name.removesuffix(".grad") for i in states if i.category is Category.GRADIENT}
    return sum(i.bytes // dtype_bytes(i.dtype) * dtype_bytes(low) for i in states
               if i.category is Category.PARAMETER and i.name in grads and i.name.endswith(".bias")
               and i.name.removesuffix(".bias") in linears)


def head_input_unsaved(saved: Inventory, dtype: str) -> int:
    """The final hidden state (``dtype``, the weights') when the LM head saved a cast of it instead."""
    cast = next((i for i in saved if i.name == "lm_head.input_cast"), None)
    return cast.bytes // dtype_bytes(cast.dtype) * dtype_bytes(dtype) if cast is not None else 0


def padded_labels(B: int, S: int) -> int:
    """ForCausalLMLoss's padded (B, S+1) int64 labels, beside the copy nll_loss keeps (none at B = 1)."""
    return B * (S + 1) * 8 if B > 1 else 0


def forward_held(model: ModelSpec, step: StepSpec, impl: ImplSpec, saved: Inventory, states: Inventory,
                 plain: Inventory | None) -> dict[str, int]:
    """The forward phase's extras (the module docstring), for an HF causal LM under the hf profile, eager,
    one inventory per model (no fine-tuning, no offload: the caller's conditions). ``plain``: the saved set
    without checkpointing (the casts a checkpointed block made in its forward), or None."""
    if impl.profile != "hf" or impl.framework != "hf" or impl.compile or model.head != "lm" \
            or model.arch != "decoder":
        return {}
    d = step.dtypes
    out = {"kv_cache_unsaved": kv_cache_unsaved(model, step, impl)}
    if step.loss == "ce":
        out["padded_labels"] = padded_labels(step.batch, step.seq)
    if d.autocast:
        out["autocast_bias_cache"] = autocast_bias_cache(states, plain if plain is not None else saved,
                                                         d.activation)
        out["head_input_unsaved"] = head_input_unsaved(saved, d.compute)
    return {k: v for k, v in out.items() if v}
