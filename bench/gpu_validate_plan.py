"""The runs of ``bench/gpu_validate.py``, ordered by value, each with a stable ``id``.

A run is one training step described three ways: estimated, traced (fake tensors) and measured. The
plan lists issue 13's mechanisms first (torch.compile per block and whole model, op-level selective
checkpointing, the optimizer implementations, Float8 under compile), then the older ladder (attention
kernels over sequence lengths, recompute full, AMP bf16, the low-bit optimizers, eager Float8), so a
time budget that runs out cuts the least important rows. ``--only`` picks rows by id.

Sizes: on CUDA two Llama-2-7B-width layers at S 4096 (the optimizer implementations at S 1024, where
the optimizer step is the peak: at S 4096 the backward's activations hide it); on CPU a tiny Llama.
The compile, op-level and Float8-compile rows step with ``optimizer_impl="fused"`` (torchtitan's
default, ``torchtitan/config/job_config.py`` ``Optimizer.implementation``): with foreach, the
optimizer step's parameter-sized temporaries are the peak of the recompute-full rows at S 4096 and
the row would check the optimizer, not what compile saves.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["Run", "Claim", "plan", "select", "LIBRARIES"]

#: the import a run needs beyond torch and transformers, by optimizer or Float8 use
LIBRARIES = {"bnb": "bitsandbytes", "torchao": "torchao"}


@dataclass(frozen=True)
class Claim:
    """What the project claims of a row's estimated peak on CPU against the trace's (logical bytes), as
    ``source`` (the test asserting it) states: equal to the byte, or within ``within_pct`` percent outside
    ``phase`` and within ``phase_pct`` where the estimate peaks in ``phase``."""

    source: str
    within_pct: float = 0.0
    phase: str | None = None
    phase_pct: float = 0.0

    def holds(self, *, estimate_bytes: int, estimate_phase: str, trace_bytes: int) -> bool:
        pct = self.phase_pct if estimate_phase == self.phase else self.within_pct
        return estimate_bytes == trace_bytes if pct == 0.0 else abs(estimate_bytes - trace_bytes) <= pct / 100 * trace_bytes


@dataclass(frozen=True, kw_only=True)
class Run:
    """One row of the plan: the step's settings (StepSpec / ImplSpec fields) and what it needs."""

    id: str
    model: str = "hf"  # hf (transformers' LlamaForCausalLM) or reference (trainmem's model)
    attention: str = "flash"
    recompute: str = "none"
    precision: str = "bf16"
    seq: int = 4096
    optimizer: str = "adamw"
    optimizer_impl: str = "auto"
    optimizer_in_backward: bool = False
    compile_scope: str | None = None  # None: eager; "block" (torchtitan's apply_compile) or "model"
    float8: str = "none"
    cpu_claim: Claim | None = None
    """Where the project claims the estimate's peak equals the trace's on CPU (the dry-run test asserts it)."""

    def __post_init__(self) -> None:
        if self.model not in ("hf", "reference"):
            raise ValueError(f"model={self.model!r}: hf or reference")
        if self.compile_scope not in (None, "block", "model"):
            raise ValueError(f"compile_scope={self.compile_scope!r}: None, block or model")

    @property
    def needs(self) -> tuple[str, ...]:
        """Python packages beyond torch and transformers (checked before the row runs)."""
        out = []
        if self.optimizer.startswith("torchao-") or self.float8 != "none":
            out.append(LIBRARIES["torchao"])
        if self.optimizer in ("adamw8bit", "paged-adamw8bit"):
            out.append(LIBRARIES["bnb"])
        return tuple(out)

    def settings(self) -> dict:
        """The row's settings as the JSON states them (no id)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("id", "cpu_claim")}


# ----------------------------------------------------------------------------------------------
# issue 13's mechanisms (docs/compile.md, docs/recompute.md, docs/optimizers.md, docs/float8.md)
# the tests asserting the estimate's peak against the trace's (peak_logical_bytes) for these steps on CPU
_BLOCK = Claim("tests/estimate/test_compiled_block_moment.py")
_FULL = Claim("tests/estimate/test_compiled_recompute.py")
_OP = Claim("tests/estimate/test_op_recompute.py")
_OP_BLOCK = Claim("tests/estimate/test_compiled_op_moment.py")
_FLOAT8 = Claim("tests/estimate/test_float8_compiled_recompute.py")
# test_optimizer_impl.py: estimate == trace where the optimizer phase is the peak (it counts the caller's ids), else
# within 0.5%; stepped in backward within 0.01% where step_in_backward is the peak (docs/optimizers.md), else 0.5%
_OPTIM = Claim("tests/estimate/test_optimizer_impl.py", within_pct=0.5, phase="optimizer")
_IN_BACKWARD = Claim("tests/estimate/test_optimizer_impl.py", within_pct=0.5,
                     phase="step_in_backward", phase_pct=0.01)


def _issue13(cpu: bool) -> list[Run]:
    # the optimizer rows at a short sequence, where the step (not the backward) is the peak: S 1024 on CUDA,
    # S 16 on the tiny CPU model; on CPU sdpa (the CPU flash kernel) for flash, as the compiled rules' tests run
    seq, optim_seq, attention = (128, 16, "sdpa") if cpu else (4096, 1024, "flash")
    fused = dict(seq=seq, attention=attention, optimizer_impl="fused")
    optim = dict(seq=optim_seq, attention=attention)
    return [
        Run(id="compile-block", compile_scope="block", cpu_claim=_BLOCK, **fused),
        Run(id="compile-block-full", compile_scope="block", recompute="full", cpu_claim=_FULL, **fused),
        Run(id="op-eager", recompute="op", cpu_claim=_OP, **fused),
        Run(id="op-compile-block", compile_scope="block", recompute="op", cpu_claim=_OP_BLOCK, **fused),
        Run(id="optim-foreach", optimizer_impl="foreach", cpu_claim=_OPTIM, **optim),
        Run(id="optim-fused", optimizer_impl="fused", cpu_claim=_OPTIM, **optim),
        Run(id="optim-for-loop", optimizer_impl="for-loop", cpu_claim=_OPTIM, **optim),
        Run(id="optim-in-backward", optimizer_in_backward=True, cpu_claim=_IN_BACKWARD, **optim),
        Run(id="compile-model", compile_scope="model", cpu_claim=_BLOCK, **fused),
        Run(id="compile-model-full", compile_scope="model", recompute="full", cpu_claim=_FULL, **fused),
        Run(id="float8-compile-block-full", compile_scope="block", recompute="full", float8="tensorwise",
            cpu_claim=_FLOAT8, **fused),
    ]


def _ladder(cpu: bool) -> list[Run]:
    """The rows bench/gpu_validate.py ran before issue 13: attention kernels over sequence lengths,
    recompute full and AMP bf16, the low-bit optimizers and eager Float8."""
    seqs, toggle = ((64, 128), 128) if cpu else ((1024, 2048, 4096, 8192), 4096)
    fused_attention = "sdpa" if cpu else "flash"
    rows = []
    for model in ("reference", "hf"):
        for attention in ("eager", "flash"):
            tag = f"{'ref' if model == 'reference' else 'hf'}-{attention}"
            rows += [Run(id=f"{tag}-s{seq}", model=model, attention=attention, seq=seq) for seq in seqs]
            rows.append(Run(id=f"{tag}-full", model=model, attention=attention, recompute="full", seq=toggle))
            rows.append(Run(id=f"{tag}-amp", model=model, attention=attention, precision="amp-bf16", seq=toggle))
    # torchao's compiled step would build C++ kernels on CPU
    for optimizer in ("adamw8bit",) if cpu else ("adamw8bit", "paged-adamw8bit", "torchao-adamw8bit",
                                                  "torchao-adamw4bit"):
        rows.append(Run(id=f"optim-{optimizer}", seq=toggle, optimizer=optimizer, attention=fused_attention))
    # eager Float8 (docs/float8.md); on CPU bf16 only (CPU autocast alone does not make Float8Linear cast its
    # input, CUDA's does)
    for precision in ("bf16",) if cpu else ("bf16", "amp-bf16"):
        for recipe in ("tensorwise",) if cpu else ("tensorwise", "rowwise"):
            rows.append(Run(id=f"float8-{recipe}-{precision}", seq=toggle, precision=precision, float8=recipe,
                            attention=fused_attention))
    return rows


def plan(cpu: bool) -> list[Run]:
    """Every run, most valuable first (tiny sizes on CPU)."""
    rows = _issue13(cpu) + _ladder(cpu)
    ids = [r.id for r in rows]
    assert len(set(ids)) == len(ids), "row ids must be unique"
    return rows


def select(rows: list[Run], only: str | None) -> list[Run]:
    """The rows named in ``--only ID[,ID...]`` (in plan order); ValueError naming an unknown id."""
    if not only:
        return rows
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    known = {r.id for r in rows}
    unknown = [w for w in wanted if w not in known]
    if unknown or not wanted:
        raise ValueError(f"only={only!r}: unknown row id {', '.join(unknown) or '(none given)'}; "
                         f"known: {', '.join(r.id for r in rows)}")
    return [r for r in rows if r.id in wanted]
