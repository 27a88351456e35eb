"""``trainmem explain``: the brief's follow-up questions (§9), answered with the user's numbers.

Every number comes from a call to the estimator (a second estimate at 2·S, at 4 micro-batches,
per ZeRO stage, for inference); the text only frames them. Answers carry their numbers as plain
integers (bytes) so tests and tools can check them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainmem.estimate import Estimate, estimate
from trainmem.estimate.inference import inference_estimate
from trainmem.estimate.params import count_parameters
from trainmem.inventory import Category
from trainmem.names import split_block
from trainmem.plan.hardware import GPU, Reserve
from trainmem.plan.ranks import per_rank_peak
from trainmem.report.units import fmt_bytes
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec
from trainmem.trace.allocator import round_size

__all__ = ["Answer", "Explanation", "explain", "SCHEMA", "QUESTIONS"]

SCHEMA = "trainmem.explain/2"
QUESTIONS = {
    "sequence_doubles": "What happens when the sequence length doubles?",
    "grad_accum": "Does gradient accumulation raise the peak?",
    "reserved_vs_allocated": "Why is reserved memory larger than allocated memory?",
    "zero_stages": "What does each ZeRO stage change, and why does it barely touch activations?",
    "weights_fit": "The weights fit on the GPU. Why does training not fit?",
    "sum_vs_peak": "Is memory the sum of all the tensors?",
    "mixed_precision": "Under mixed precision, is every state 2 bytes?",
    "train_vs_inference": "How do training and inference memory differ?",
}


@dataclass(frozen=True)
class Answer:
    key: str
    question: str
    answer: str
    numbers: dict

    def to_dict(self) -> dict:
        return {"key": self.key, "question": self.question, "answer": self.answer, "numbers": self.numbers}


@dataclass(frozen=True)
class Explanation:
    model: ModelSpec
    step: StepSpec
    impl: ImplSpec
    answers: tuple[Answer, ...]
    notes: tuple[str, ...] = ()
    """The estimate's notes: settings that change next to nothing here (:mod:`trainmem.estimate.notes`)."""

    def to_dict(self) -> dict:
        from trainmem.schemas import header
        return {**header("explain", model=self.model, step=self.step, impl=self.impl), "notes": list(self.notes), "answers": [a.to_dict() for a in self.answers]}


def _acts(e: Estimate) -> dict[str, int]:
    return {i.name: i.bytes for i in e.inventory if i.category is Category.ACTIVATION}


def _pattern(name: str) -> str:
    """``model.layers.3.mlp.out`` -> ``model.layers.*.mlp.out`` (names outside blocks unchanged)."""
    block = split_block(name)
    return name if block is None else f"{block[0]}*.{block[2]}"


def sequence_doubles(model, step, impl) -> Answer:
    s1 = step.seq
    if model.max_positions and 2 * s1 > model.max_positions:  # learned positions stop at S: double S/2
        s1 = max(step.seq // 2, 1)
    e1 = estimate(model, replace(step, seq=s1), impl)
    e2 = estimate(model, replace(step, seq=2 * s1), impl)
    a1, a2 = _acts(e1), _acts(e2)
    groups = {"x2": [0, 0, set()], "x4": [0, 0, set()], "other": [0, 0, set()]}
    for name, b1 in a1.items():
        b2 = a2.get(name, 0)
        r = b2 / b1 if b1 else 0
        key = "x2" if abs(r - 2) < 0.05 else "x4" if abs(r - 4) < 0.1 else "other"
        g = groups[key]
        g[0] += b1
        g[1] += b2
        g[2].add(_pattern(name))
    nums = {"seq": s1, "seq_doubled": 2 * s1,
            "activation_bytes": [e1.totals_bytes["activation"], e2.totals_bytes["activation"]],
            "linear_bytes": groups["x2"][:2], "quadratic_bytes": groups["x4"][:2], "other_bytes": groups["other"][:2],
            "quadratic_tensors": sorted(groups["x4"][2]), "other_tensors": sorted(groups["other"][2]),
            "peak_bytes": [e1.peak_bytes, e2.peak_bytes], "peak_phase": [e1.peak_phase, e2.peak_phase],
            "model_state_bytes": [sum(e1.totals_bytes[k] for k in ("parameter", "gradient", "master_weight", "optimizer_state"))] * 2}
    if groups["x4"][0]:
        quad = (f"the attention matrices ({', '.join(sorted(groups['x4'][2])[:4])}) grow ×4: "
                f"{fmt_bytes(groups['x4'][0])} → {fmt_bytes(groups['x4'][1])}")
    else:
        quad = f"nothing grows ×4: {impl.attention} attention saves no S×S matrix"
    text = ("" if s1 == step.seq else f"The model has {model.max_positions} learned positions, too few to double "
            f"S={step.seq}; S doubles from {s1} instead. ")
    text += (f"At S={s1} → {2 * s1}, the B·S·H-type activations double "
             f"({fmt_bytes(groups['x2'][0])} → {fmt_bytes(groups['x2'][1])}); {quad}. "
             f"All saved activations: {fmt_bytes(nums['activation_bytes'][0])} → {fmt_bytes(nums['activation_bytes'][1])}. "
             f"Model states do not change, so the peak goes {fmt_bytes(e1.peak_bytes)} → {fmt_bytes(e2.peak_bytes)} "
             f"(×{e2.peak_bytes / e1.peak_bytes:.2f}).")
    if groups["other"][0]:
        text += f" Terms that neither double nor quadruple (sequence-independent or rounded): {fmt_bytes(groups['other'][0])}."
    return Answer("sequence_doubles", QUESTIONS["sequence_doubles"], text, nums)


def grad_accum(model, step, impl) -> Answer:
    k = step.grad_accum if step.grad_accum > 1 else 4
    e1 = estimate(model, replace(step, grad_accum=1), impl)
    ek = estimate(model, replace(step, grad_accum=k), impl)
    nums = {"grad_accum": [1, k], "activation_bytes": [e1.totals_bytes["activation"], ek.totals_bytes["activation"]],
            "peak_bytes": [e1.peak_bytes, ek.peak_bytes], "peak_phase": [e1.peak_phase, ek.peak_phase],
            "gradient_bytes": e1.totals_bytes["gradient"], "increase_bytes": ek.peak_bytes - e1.peak_bytes}
    text = (f"Micro-batches run forward and backward one after another, so saved activations stay at "
            f"{fmt_bytes(nums['activation_bytes'][1])} for {k} micro-batches, as for one. ")
    if ek.peak_bytes > e1.peak_bytes:
        text += (f"The peak does rise, {fmt_bytes(e1.peak_bytes)} ({e1.peak_phase}) → {fmt_bytes(ek.peak_bytes)} "
                 f"({ek.peak_phase}), by {fmt_bytes(nums['increase_bytes'])}: from the second micro-batch on the "
                 f"gradients ({fmt_bytes(nums['gradient_bytes'])}) already exist while activations are saved. "
                 f"It does not grow further with more micro-batches; the cost is throughput (smaller GEMMs, more steps).")
    else:
        text += (f"The peak stays {fmt_bytes(e1.peak_bytes)} ({e1.peak_phase}): it is set where all gradients "
                 f"exist anyway, so holding them across micro-batches adds nothing.")
    return Answer("grad_accum", QUESTIONS["grad_accum"], text, nums)


def reserved_vs_allocated(model, step, impl, e: Estimate) -> Answer:
    t = e.totals_bytes
    steady = t["parameter"] + t["master_weight"] + t["optimizer_state"]
    rounding = sum(round_size(i.bytes) - i.bytes for i in e.inventory)
    nums = {"peak_bytes": e.peak_bytes, "peak_phase": e.peak_phase, "allocated_between_steps_bytes": steady,
            "reserved_at_least_bytes": e.peak_bytes + rounding, "rounding_bytes": rounding,
            "gap_bytes": e.peak_bytes + rounding - steady}
    text = (f"PyTorch's caching allocator keeps freed blocks for reuse instead of returning them. Your step peaks at "
            f"{fmt_bytes(e.peak_bytes)} in '{e.peak_phase}'; once the activations and gradients are freed, allocated "
            f"memory falls to the model states ({fmt_bytes(steady)}), but reserved stays at least at the peak plus "
            f"512-byte rounding ({fmt_bytes(rounding)}) — {fmt_bytes(nums['gap_bytes'])} more than allocated — plus "
            f"whatever fragmentation leaves unusable. Reserved is cached capacity, not live tensors.")
    return Answer("reserved_vs_allocated", QUESTIONS["reserved_vs_allocated"], text, nums)


def zero_stages(model, step, impl, e: Estimate, ranks: int) -> Answer:
    t = e.totals_bytes
    P, G, M, O, A = (t["parameter"], t["gradient"], t["master_weight"], t["optimizer_state"], t["activation"])
    stages = {}
    for z in range(4):
        shard = {"parameter": P // ranks if z >= 3 else P, "gradient": G // ranks if z >= 2 else G,
                 "master_weight": M // ranks if z >= 1 else M, "optimizer_state": O // ranks if z >= 1 else O,
                 "activation": A}
        shard["peak_bytes"] = per_rank_peak(model, step, impl, ParallelSpec(dp=ranks, zero=z))
        stages[f"zero{z}"] = shard
    nums = {"ranks": ranks, "stages": stages, "peak_source": "estimator"}
    z0, z3 = stages["zero0"], stages["zero3"]
    text = (f"Over {ranks} data-parallel ranks: ZeRO-1 shards optimizer states and master weights "
            f"({fmt_bytes(O + M)} → {fmt_bytes(stages['zero1']['optimizer_state'] + stages['zero1']['master_weight'])} "
            f"per rank), ZeRO-2 also gradients ({fmt_bytes(G)} → {fmt_bytes(stages['zero2']['gradient'])}), "
            f"ZeRO-3/FSDP also parameters ({fmt_bytes(P)} → {fmt_bytes(stages['zero3']['parameter'])}). Peak per rank: "
            + ", ".join(f"stage {z} {fmt_bytes(stages[f'zero{z}']['peak_bytes'])}" for z in range(4))
            + f". Activations stay {fmt_bytes(A)} at every stage: each rank still runs a whole micro-batch through "
              f"every layer, and ZeRO partitions model states, not the tokens or the hidden dimension — "
              f"that takes smaller micro-batches, checkpointing, or sequence/tensor/context parallelism.")
    if z0["peak_bytes"]:
        nums["activation_share_zero3"] = A / z3["peak_bytes"] if z3["peak_bytes"] else 0.0
    return Answer("zero_stages", QUESTIONS["zero_stages"], text, nums)


def weights_fit(model, step, impl, e: Estimate, gpu: GPU | None) -> Answer:
    t = e.totals_bytes
    nums = {"parameter_bytes": t["parameter"], "gradient_bytes": t["gradient"],
            "master_weight_bytes": t["master_weight"], "optimizer_state_bytes": t["optimizer_state"],
            "activation_bytes": t["activation"], "peak_bytes": e.peak_bytes, "peak_phase": e.peak_phase,
            "peak_over_weights": e.peak_bytes / t["parameter"]}
    text = (f"The weights are {fmt_bytes(t['parameter'])}, but training also holds gradients "
            f"({fmt_bytes(t['gradient'])}), master weights ({fmt_bytes(t['master_weight'])}), optimizer states "
            f"({fmt_bytes(t['optimizer_state'])}) and saved activations ({fmt_bytes(t['activation'])}); the peak is "
            f"{fmt_bytes(e.peak_bytes)} in '{e.peak_phase}', {nums['peak_over_weights']:.1f}× the weights.")
    if gpu is not None:  # the training step: its reserved peak (allocator model), as plan and advise decide
        from trainmem.estimate.allocation_order import estimate_fit_state, estimate_reserved
        usable = Reserve.modelled(gpu).reserved_usable_bytes(gpu)
        reserved = estimate_reserved(e).reserved_bytes
        state = estimate_fit_state(e, usable)[0]
        nums.update(gpu=gpu.name, usable_bytes=usable, weights_fit=t["parameter"] <= usable,
                    peak_reserved_bytes=reserved, training_fits=state == "fits", fit_state=state)
        step_fits = {"fits": "fits", "does_not_fit": "does not",
                     "fits_with_cache_flush": "fits only by flushing the allocator cache (its reserved peak is over "
                                              "usable; on a failed cudaMalloc the allocator frees its cached "
                                              "segments and retries, a synchronizing and slower step)"}[state]
        text += (f" On {gpu.name} ({fmt_bytes(usable)} usable) the weights {'fit' if nums['weights_fit'] else 'do not fit'}"
                 f" and the training step ({fmt_bytes(reserved)} reserved) {step_fits}.")
    return Answer("weights_fit", QUESTIONS["weights_fit"], text, nums)


def sum_vs_peak(e: Estimate) -> Answer:
    total = sum(e.totals_bytes.values())
    nums = {"sum_of_ledgers_bytes": total, "peak_bytes": e.peak_bytes, "peak_phase": e.peak_phase,
            "phases": {p.name: p.bytes for p in e.phases}}
    text = (f"No: all ledgers together are {fmt_bytes(total)}, but they are never all alive at once. Activations are "
            f"freed during backward while gradients appear, so the peak is {fmt_bytes(e.peak_bytes)} in "
            f"'{e.peak_phase}' (" + ", ".join(f"{p.name} {fmt_bytes(p.bytes)}" for p in e.phases) + ").")
    return Answer("sum_vs_peak", QUESTIONS["sum_vs_peak"], text, nums)


def _low_bit(step) -> bool:
    """Whether the optimizer keeps its library's own state dtypes, not the recipe's: bitsandbytes'
    fp32 or uint8 states whatever the parameter (``init_state``), torchao's quantized ones."""
    from trainmem.estimate.state_items import BNB, TORCHAO
    return step.optimizer in BNB or step.optimizer in TORCHAO


def mixed_precision(model, step, e: Estimate) -> Answer:
    n = count_parameters(model)
    t = e.totals_bytes
    per = {k: t[k] / n for k in ("parameter", "gradient", "master_weight", "optimizer_state")}
    if t.get("paged_optimizer_state"):  # bitsandbytes' paged states: unified memory, outside the peak
        per["paged_optimizer_state"] = t["paged_optimizer_state"] / n
    nums = {"parameters": n, "bytes_per_parameter": per, "precision": step.precision, "optimizer": step.optimizer}
    text = (f"With {step.precision} and {step.optimizer}, each of the {n:,} parameters costs "
            + ", ".join(f"{per[k]:g} B of {k.replace('_', ' ')}" for k in per)
            + f": {sum(per.values()):g} bytes in all. " + (
                f"{step.optimizer} lays its states out as its library does (docs/optimizers.md)." if _low_bit(step) else
                "Master weights and optimizer states stay fp32 here." if step.dtypes.master else
                "This recipe keeps no fp32 master copy; " + (
                    "states are fp32 (autocast keeps fp32 parameters)." if step.dtypes.autocast else
                    f"states are {step.dtypes.state}, which loses small updates in pure 16-bit training.")))
    return Answer("mixed_precision", QUESTIONS["mixed_precision"], text, nums)


def train_vs_inference(model, step, impl, e: Estimate) -> Answer:
    inf = inference_estimate(model, replace(step, grad_accum=1), impl, context=step.seq)
    kv = inf.totals_bytes.get("kv_cache", 0)
    nums = {"training_peak_bytes": e.peak_bytes, "inference_peak_bytes": inf.peak_bytes,
            "inference_peak_phase": inf.peak_phase, "weights_bytes": inf.totals_bytes["parameter"],
            "kv_cache_bytes": kv, "training_activation_bytes": e.totals_bytes["activation"],
            "prefill_bytes": next(p.bytes for p in inf.phases if p.name == "prefill")}
    text = (f"Training this step peaks at {fmt_bytes(e.peak_bytes)}: states for the optimizer plus "
            f"{fmt_bytes(nums['training_activation_bytes'])} of activations saved for backward. Serving the same "
            f"{step.batch}×{step.seq} tokens needs {fmt_bytes(inf.peak_bytes)}: the weights "
            f"({fmt_bytes(nums['weights_bytes'])}), a KV cache of {fmt_bytes(kv)} that grows with batch × context, "
            f"and one block's working set at a time, since nothing is kept for backward. A training OOM is fixed "
            f"with checkpointing, smaller micro-batches or sharding; an inference OOM with a smaller batch or "
            f"context, GQA/MQA, or a quantized cache.")
    return Answer("train_vs_inference", QUESTIONS["train_vs_inference"], text, nums)


def explain(model: ModelSpec, step: StepSpec, impl: ImplSpec, *, gpu: GPU | None = None,
            zero_ranks: int = 8) -> Explanation:
    """Answers to every question in :data:`QUESTIONS`, computed for this configuration."""
    e = estimate(model, step, impl)
    answers = (
        sequence_doubles(model, step, impl),
        grad_accum(model, step, impl),
        reserved_vs_allocated(model, step, impl, e),
        zero_stages(model, step, impl, e, zero_ranks),
        weights_fit(model, step, impl, e, gpu),
        sum_vs_peak(e),
        mixed_precision(model, step, e),
        train_vs_inference(model, step, impl, e),
    )
    return Explanation(model, step, impl, answers, e.notes)
