"""Notes an estimate carries: settings that, by the estimator's own numbers, change next to
nothing for this configuration, so that no report offers a no-op as a choice.

Known limitations:
- Only selective recompute is checked. The single-device saved set decides; under parallelism
  each rank keeps the same kinds of tensors, so the verdict carries over.
"""

from __future__ import annotations

from dataclasses import replace

from trainmem.estimate.activations import activation_inventory
from trainmem.inventory import Category, Inventory
from trainmem.report.units import fmt_bytes
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

__all__ = ["selective_recompute_noop", "float8_noop", "estimate_notes", "lora_targets_note"]


def _has_score_matrix(inv: Inventory, seq: int) -> bool:
    """Whether any saved activation is a (B, heads, S, S) matrix (one block's template suffices)."""
    templates = (*inv.base, *(i for r in inv.repeats for i in r.items))
    return any(i.category is Category.ACTIVATION and len(i.shape) == 4 and i.shape[-2:] == (seq, seq)
               for i in templates)


def selective_recompute_noop(model: ModelSpec, step: StepSpec, impl: ImplSpec) -> str | None:
    """Why selective recompute changes next to nothing with ``impl``'s attention kernel, or None
    when it drops something worth having.

    Selective recompute (Megatron-LM's ``--recompute-granularity selective``; Korthikanti et al.,
    "Reducing Activation Recomputation in Large Transformer Models", §4.2) checkpoints the
    attention core so that its S×S scores, probabilities and dropout mask are not kept. A fused
    kernel (flash, memory-efficient: what SDPA runs on CUDA) never keeps them; checkpointing it
    drops only its log-sum-exp, and the attention forward still runs again in backward."""
    none = replace(impl, recompute="none", recompute_every=1)
    plain = activation_inventory(model, step, none)
    if _has_score_matrix(plain, step.seq):
        return None
    selective = activation_inventory(model, step, replace(none, recompute="selective"))
    before = plain.total(Category.ACTIVATION)
    saved = before - selective.total(Category.ACTIVATION)
    share = f", {saved / before:.2%} of the activations" if before else ""
    return (f"selective recompute changes next to nothing here: it exists to drop the attention core's S×S "
            f"scores and probabilities, which the {impl.attention} attention kernel never saves; it saves "
            f"{fmt_bytes(saved)}{share}, and still runs the attention forward again in backward")


def lora_targets_note(model: ModelSpec, finetune) -> tuple[str, ...]:
    """LoRA on the family's default targets where peft has none for its ``model_type``: real
    ``get_peft_model`` without ``target_modules`` raises there (``LoraModel._prepare_adapter_config``)."""
    from trainmem.families import PEFT_VERSION, family_of
    fam = family_of(model)
    if finetune is None or not finetune.adapters or fam.peft_default or finetune.lora_targets != fam.lora_targets:
        return ()
    return (f"peft {PEFT_VERSION} has no default target_modules for model_type {fam.name} (get_peft_model raises "
            f"without them); the adapters are on {','.join(fam.lora_targets)}, this family's choice: pass "
            f"--lora-targets to match your LoraConfig",)


def float8_noop(model: ModelSpec, impl: ImplSpec) -> str | None:
    """Why ``--float8`` converts nothing in ``model``, or None when it converts a linear. torchao's
    ``convert_to_float8_training`` swaps ``nn.Linear`` modules only (torchao/float8/float8_linear_utils.py
    ``swap_linear_layers``), through the filter (estimate/float8.py): GPT-2's ``Conv1D`` blocks are no
    ``nn.Linear`` and its head is filtered, so the step is the unconverted one, byte for byte."""
    from trainmem.estimate.float8 import converted_parameters
    if impl.float8 == "none" or converted_parameters(model):
        return None
    return (f"--float8 {impl.float8} converts nothing in this model: torchao swaps nn.Linear modules only "
            "(the blocks here are not nn.Linear, e.g. GPT-2's Conv1D) and the output head is filtered; the step "
            "runs in high precision as without --float8")


def estimate_notes(model: ModelSpec, step: StepSpec, impl: ImplSpec) -> tuple[str, ...]:
    """Every note that applies to an estimate of ``model`` with ``step`` and ``impl``."""
    if step.mode != "train":  # inference keeps nothing for backward, and Float8 training is refused there
        return ()
    notes = (float8_noop(model, impl),)
    if impl.recompute == "selective":
        notes += (selective_recompute_noop(model, step, impl),)
    return tuple(n for n in notes if n)
