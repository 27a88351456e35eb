"""The analytic estimator: four ledgers, a per-tensor activation inventory, and the peak.

>>> from trainmem.estimate import estimate
>>> from trainmem.specs import StepSpec, ImplSpec
>>> from trainmem.specs.loaders import load_model
>>> e = estimate(load_model("llama-2-7b"), StepSpec(batch=1, seq=4096, precision="bf16"), ImplSpec())
>>> e.peak_phase in {p.name for p in e.phases}
True
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from trainmem.errors import SpecError
from trainmem.estimate.activations import activation_inventory, activation_items
from trainmem.estimate.activation_offload import apply_offload, offloads_activations
from trainmem.estimate.attention import kernel_for
from trainmem.estimate.compiled_embedding_backward import head_graph_apart
from trainmem.estimate.autocast_cache import autocast_cached_casts, autocast_head_input
from trainmem.estimate.buffers import buffer_inventory
from trainmem.estimate.compiled_op_moment import recomputes_blocks
from trainmem.estimate.compiled_recompute import block_math
from trainmem.estimate.forward_held import forward_held
from trainmem.estimate.finetune import dequant_transient, head_dequant, with_dequant_transient
from trainmem.estimate.heads import check_head, logits_width
from trainmem.estimate.losses import FRAMEWORK_LOSSES
from trainmem.families import default_attention
from trainmem.estimate.notes import estimate_notes, lora_targets_note
from trainmem.estimate.model_states import model_state_inventory, model_state_items, optimizer_transient
from trainmem.estimate.optimizer_step import optimizer_impl_used
from trainmem.estimate.parallel import RankClass, rank_classes
from trainmem.estimate.peak import Compiled, Phase, PhasedResult, PhaseInputs, Recompute, phases, recompute_per_layer
from trainmem.inventory import Inventory, dtype_bytes
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.step import default_seq

__all__ = ["estimate", "Estimate"]

SCHEMA = "trainmem.estimate/2"


@dataclass(frozen=True)
class Estimate(PhasedResult):
    """The result of :func:`estimate`. Bytes are logical (elements × item size)."""

    model: ModelSpec
    step: StepSpec
    impl: ImplSpec
    inventory: Inventory
    phases: tuple[Phase, ...]
    parallel: ParallelSpec = ParallelSpec()
    finetune: FinetuneSpec | None = None  # None: every parameter trains
    ranks: tuple[RankClass, ...] = ()
    """Per-rank classes under parallelism (empty on one device). The top-level inventory and
    phases are then those of the rank class with the highest peak."""
    host: Inventory | None = None
    """Activations offloaded to host memory (``--offload activations``, one device): in no phase."""

    def _repr_html_(self) -> str:  # Jupyter
        from trainmem.report.notebook import estimate_html
        return estimate_html(self)

    @property
    def peak_phase(self) -> str:
        return self.peak.name

    @property
    def optimizer_impl(self) -> str:
        """The implementation ``optimizer.step()`` runs: ``impl.optimizer_impl`` with ``auto`` resolved."""
        return optimizer_impl_used(self.step, self.impl)

    @cached_property
    def notes(self) -> tuple[str, ...]:
        """Settings that change next to nothing here, and why (:mod:`trainmem.estimate.notes`)."""
        return estimate_notes(self.model, self.step, self.impl) + lora_targets_note(self.model, self.finetune)

    @property
    def peak_rank(self) -> str | None:
        return max(self.ranks, key=lambda r: r.peak_bytes).name if self.ranks else None

    def to_dict(self, *, items: bool = True) -> dict:
        from trainmem.schemas import header
        out = {
            **header("estimate", model=self.model, step=self.step, impl=self.impl, parallel=self.parallel,
                     finetune=self.finetune),
            "profile": self.impl.profile,
            "totals_bytes": self.totals_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase,
            "phases": [p.to_dict() for p in self.phases],
            "notes": list(self.notes),
        }
        if self.host is not None:
            out["host_bytes"] = {"offloaded_activations": self.host.total()}
        if self.ranks:
            out["peak_rank"] = self.peak_rank
            out["ranks"] = [r.to_dict() for r in self.ranks]
        if items:
            out["items"] = [i.to_dict() for i in self.inventory]
        return out


def estimate(model: ModelSpec, step: StepSpec | None = None, impl: ImplSpec | None = None,
             parallel: ParallelSpec | None = None, *, finetune: FinetuneSpec | None = None) -> Estimate:
    """Estimate one training step of ``model``: every parameter, gradient, master weight,
    optimizer state and saved activation, and the phase-by-phase peak.

    ``parallel``: per-rank results under DP/TP/SP/CP/EP/PP, ZeRO/FSDP and offload
    (``estimate/parallel.py``); the result's ``ranks`` lists every rank class.
    ``finetune``: frozen parameters, LoRA adapters, a QLoRA 4-bit base (``estimate/finetune.py``)."""
    step = step or StepSpec(seq=default_seq(model.max_positions))
    impl = impl or ImplSpec(attention=default_attention(model.family))  # gpt-oss, Gemma-2: eager
    finetune = finetune.for_model(model) if finetune is not None else None  # LoRA targets: the family's default
    if model.max_positions and step.seq > model.max_positions:
        raise SpecError("seq", step.seq, f"exceeds the {model.name} model's learned positions "
                                         f"(max_positions={model.max_positions})")
    if finetune is not None and impl.profile != "hf":
        # the reference and megatron rules name modules their own way (attn.q, the paper's closed forms):
        # LoRA targets and frozen-parameter patterns are HF module names, so they would match nothing
        raise SpecError("profile", impl.profile, "fine-tuning (LoRA, QLoRA, --freeze) is modelled under "
                                                 "--profile hf only")
    check_head(model, impl, parallel, finetune)
    if step.loss in FRAMEWORK_LOSSES and impl.profile != "hf":  # estimate/losses.py
        raise SpecError("loss", step.loss, "is modelled on Hugging Face modules (--profile hf): the framework's "
                                           "loss runs on the model's last hidden state")
    if step.dtypes.gathered and (parallel is None or not parallel.fsdp):
        raise SpecError("precision", step.precision, "is FSDP2's MixedPrecisionPolicy and needs FSDP (--fsdp); "
                                                     "without FSDP torchtitan autocasts: amp-bf16")
    if impl.profile == "traced":  # estimate/traced: what is kept and every parameter, read off a fake-tensor trace
        from trainmem.estimate.traced import check_traced
        check_traced(step, impl, parallel, finetune)
    offload = offloads_activations(parallel)  # --offload activations alone runs one device
    if finetune is not None and finetune.mode == "qlora" and finetune.quant_impl == "bnb-legacy" and (
            offload or (parallel is not None and not parallel.is_single)):
        raise SpecError("quant_impl", "bnb-legacy", "is modelled on one device without offload only")
    if parallel is not None and not parallel.is_single and not offload:
        if impl.optimizer_in_backward:
            raise SpecError("optimizer_in_backward", True, "is modelled on one device only (no --dp/--tp/--pp/--zero/--fsdp)")
        ranks = tuple(rank_classes(model, step, impl, parallel, finetune))
        worst = max(ranks, key=lambda r: r.peak_bytes)
        return Estimate(model, step, impl, worst.inventory, worst.phases, parallel=parallel,
                        finetune=finetune, ranks=ranks)
    plain_impl = replace(impl, recompute="none", recompute_every=1)
    if impl.compile and finetune is not None:  # what a fully recomputed compiled block recomputes: the eager
        plain_impl = replace(plain_impl, compile=False, compile_scope="model")  # block's set (upper bound)
    # HF gradient checkpointing turns the KV cache off for the whole model, its eager blocks under every-k too
    # (``*Model.forward``: ``use_cache = False``; Ctx.kv_cache)
    cache = impl.recompute not in ("full", "every-k", "op")
    stack_held = 0  # --profile traced, an encoder-decoder: its last stack's locals (peak.py stack_end)
    stacks = ()  # --profile traced: the template's stacks of blocks, an encoder-decoder's two (peak.layer_stats)
    if impl.profile == "traced":
        from trainmem.estimate.traced import traced_parts
        acts, states, plain, traced_transient = traced_parts(model, step, impl)
        from trainmem.estimate.traced import traced_stack_held, traced_stacks
        stack_held, stacks = traced_stack_held(model, step, impl), traced_stacks(model, step, impl)
    elif finetune is None:  # identical blocks stored once: the cost of one block, however deep
        acts = activation_inventory(model, step, impl, kv_cache=cache)
        states = model_state_inventory(model, step, impl.profile)
        plain = activation_inventory(model, step, plain_impl, kv_cache=False) if impl.recompute != "none" else None
    else:  # fine-tuning may freeze some blocks and not others: every block is its own
        acts = Inventory(activation_items(model, step, impl, finetune, kv_cache=cache))
        states = Inventory(model_state_items(model, step, finetune))
        plain = (Inventory(activation_items(model, step, plain_impl, finetune, kv_cache=False,  # block 0: rules_hf_parts.py
                                            checkpointed=impl.recompute in ("full", "every-k")))
                 if impl.recompute != "none" else None)
    inv = states + acts
    recompute = recompute_per_layer(acts, plain, stacks) if plain is not None else {}
    working, host = None, None
    if offload:  # estimate/activation_offload.py: torchtune's OffloadActivations
        inv, recompute, working, host = apply_offload(model, step, impl, states, acts, recompute, finetune)
    inv = inv + buffer_inventory(model, step, impl.profile)  # estimate/buffers.py: resident all step, in every phase
    d = step.dtypes
    held = ({"autocast_weight_cache": autocast_cached_casts(acts, plain), "head_input_unsaved": autocast_head_input(acts)}
            if d.autocast and not impl.compile and finetune is None and not offload else {})
    if not offload:  # the KV cache, bias casts, padded labels at the loss (estimate/forward_held.py)
        held.update(forward_held(model, step, impl, states, finetune))
    if any(held.values()):  # alive to the end of the forward and loss (estimate/autocast_cache.py): the forward phase's
        working = {**(working or {}), "forward": {**(working or {}).get("forward", {}), **held}}
    resid_dtype = d.compute
    lsm = next((i for i in acts.base if i.name == "loss.log_softmax"), None)
    kernel = kernel_for(model, step, impl)  # the attention core's moments (selective_moments.py, encoder_forward.py)
    ph = phases(inv, PhaseInputs(
        batch=step.batch, seq=step.seq, vocab=logits_width(model),
        logits_dtype=d.activation if d.autocast else d.compute, loss=step.loss,
        loss_dtype=lsm.dtype if lsm else "float32",
        grad_accum=step.grad_accum,
        optimizer_transient=(traced_transient if impl.profile == "traced"
                             else optimizer_transient(model, step, states, finetune, impl)),
        residual_bytes=int(step.batch * step.seq * model.hidden_size * dtype_bytes(resid_dtype)),
        optimizer_in_backward=impl.optimizer_in_backward, working=working or {},
        attention_kernel=kernel,
        stack_held=stack_held, stacks=stacks,
        optimizer_batch=_caller_batch(model, step),
        tied_head=model.tied_embeddings and model.head not in ("seq-cls", "token-cls"),
        accumulate_transients=True,  # one device: estimate/grad_accum.py
        recompute=Recompute(
            per_block=recompute,
            recomputed=plain if recomputes_blocks(impl) and not offload else None,  # block_backward.py, compiled_op_moment.py
            attention_only=impl.recompute == "selective"),  # its blocks' node moments read their saved sets
        compiled=Compiled(
            loss=impl.compile and impl.compile_scope == "block-loss" and step.loss == "torchtune-chunked-ce",
            # estimate/compiled_recompute.py: the MLP activation, Gemma's norm; a fine-tuned compiled block recomputes
            # its eager set (plain_impl above: estimate/compiled_finetune_moment.py)
            block_math=block_math(model, eager_set=impl.compile and finetune is not None,
                                  one_graph=impl.compile and impl.compile_scope == "model"),
            head_graph_apart=head_graph_apart(impl)),  # estimate/compiled_embedding_backward.py
    ))
    if not offload:  # BERT's last-block forward moments: the math attention's fp32 copies, the last LayerNorm
        from trainmem.estimate.encoder_forward import with_encoder_forward
        ph = with_encoder_forward(ph, inv, model, step, impl, kernel, finetune)
        from trainmem.estimate.encoder_backward import with_encoder_backward  # its blocks' node moments
        ph = with_encoder_backward(ph, inv, model, step, impl, kernel, finetune, plain)
        from trainmem.estimate.decoder_forward import with_decoder_forward  # GPT-2's last residual add
        ph = with_decoder_forward(ph, inv, model, step, impl, finetune)
    if offload and impl.recompute == "none" and not impl.compile and not impl.optimizer_in_backward:
        from trainmem.estimate.offload_moments import with_offload_moments  # the tensors brought back at a node
        ph = with_offload_moments(ph, acts, inv, residual_bytes=step.batch * step.seq * model.hidden_size * dtype_bytes(
            resid_dtype), loss=step.loss, loss_dtype=lsm.dtype if lsm else "float32", grad_accum=step.grad_accum)
    if impl.recompute == "op" and impl.profile == "hf" and not impl.compile and not offload and \
            not impl.optimizer_in_backward:  # estimate/op_moments.py: its blocks' nodes on their recomputed sets
        from trainmem.estimate.op_moments import with_op_moments
        ph = with_op_moments(ph, inv, plain, residual_bytes=step.batch * step.seq * model.hidden_size * dtype_bytes(
            resid_dtype), loss=step.loss, loss_dtype=lsm.dtype if lsm else "float32", grad_accum=step.grad_accum)
    if finetune is not None and finetune.quant_impl == "bnb-legacy":  # held until the graph is freed
        from trainmem.estimate.bnb_legacy import with_held_inputs
        ph = with_held_inputs(ph, acts, loop_holds_graph=step.loss == "litgpt-chunked-ce")
    if finetune is not None:  # QLoRA: one dequantized weight alive during forward and backward
        from trainmem.estimate.block_backward import block_items
        from trainmem.estimate.quant4bit_moments import four_bit_moments_modelled
        ph = with_dequant_transient(ph, *dequant_transient(model, finetune, impl.compile),
                                    *head_dequant(model, step, finetune), node_moments_hold_it=not impl.compile and
                                    four_bit_moments_modelled(block_items(inv, model.num_layers - 1), d.autocast,
                                                              block_items(plain, model.num_layers - 1) if plain else None),
                                    backward=dequant_transient(model, finetune, impl.compile, weight_dtype=d.param))
    if finetune is not None and finetune.adapters and not impl.compile:  # estimate/adapter_forward.py
        from trainmem.estimate.adapter_forward import with_adapter_forward
        ph = with_adapter_forward(ph, inv, tokens=step.batch * step.seq, hidden=model.hidden_size,
                                  residual_dtype=resid_dtype, lora_dropout=finetune.lora_dropout)
    return Estimate(model, step, impl, inv, tuple(ph), finetune=finetune,
                    **({"parallel": parallel, "host": host} if offload else {}))


def _caller_batch(model: ModelSpec, step: StepSpec) -> int:
    """The caller's batch, bound through ``optimizer.step()`` (``PhaseInputs.optimizer_batch``): its (B, S) int64
    token ids, and a classifier's labels, a tensor of their own (trace/step.py ``_inputs``: (B,) for seq-cls,
    (B, S) for token-cls, int64); an LM's labels are its ids."""
    labels = {"seq-cls": step.batch * 8, "token-cls": step.batch * step.seq * 8}.get(model.head, 0)
    return step.batch * step.seq * 8 + labels
