"""Compile settings in input files -> ``--compile`` with the framework's scope, when the estimator
can model it; otherwise the estimate stays eager and one note line says why.

What each framework compiles (read from its source):

* Hugging Face ``Trainer`` (``torch_compile``, or ``torch_compile_backend``/``_mode``, which turn it
  on in ``TrainingArguments.__post_init__``): the Trainer hands a ``TorchDynamoPlugin`` to
  accelerate (``Trainer._build_accelerator_args``), and ``Accelerator.prepare_model`` runs
  ``torch.compile(model)`` on the whole model (``use_regional_compilation`` is off): scope ``model``.
* torchtitan (``[compile] enable``, ``components`` default ``["model", "loss"]``,
  ``torchtitan/config/job_config.py`` ``Compile``): ``apply_compile``
  (``torchtitan/models/llama3/infra/parallelize.py``) compiles each ``TransformerBlock`` after
  activation checkpointing wrapped it; ``build_cross_entropy_loss`` (``components/loss.py``)
  compiles the loss when ``"loss"`` is a component: scope ``block`` or ``block-loss``.
* torchtune (``compile: true``, or the distributed recipe's mapping ``{model, loss, ...}``, each
  default true): ``training.compile_model`` compiles each ``TransformerSelfAttentionLayer`` and
  ``training.compile_loss`` the loss (``torchtune/training/_compile.py``): ``block-loss``.

A backend other than inductor is not inductor's partition: noted, estimated eager.
"""

from __future__ import annotations

from dataclasses import replace

from trainmem.errors import ConfigError
from trainmem.inputs._common import typed, unknown_key

__all__ = ["compile_to", "compile_from_files", "hf_compile", "torchtitan_compile", "torchtune_compile"]

TRACE_HINT = "trainmem trace --compile gives the compiled saved set"
MAPPED = ": --compile --compile-scope "  # compile_to's note


def compile_to(impl: dict, notes: list[str], key: str, scope: str | None, why: str) -> None:
    """Set ``--compile --compile-scope scope`` from ``key`` (one note saying so); ``scope`` None:
    what the file compiles has no scope here, noted as estimated eager."""
    if scope is None:
        notes.append(f"{key}: estimated as eager, {why}; {TRACE_HINT}")
        return
    impl["compile"] = True
    impl["compile_scope"] = scope
    notes.append(f"{key}{MAPPED}{scope} ({why})")


def compile_from_files(files: dict, model, step, impl, parallel=None, finetune=None):
    """``impl`` as the estimate can run it: a compile that a file set (not the command line) and
    the compiled rules refuse becomes eager, with one note in that file's notes (text and JSON
    ``inputs.files``) naming the reason; a compile typed as ``--compile`` is refused as before."""
    source = files.get("applied", {}).get("impl.compile") if files else None
    if not impl.compile or source is None:
        return impl
    from trainmem.errors import TrainmemError
    from trainmem.estimate import estimate
    from trainmem.families import family_of
    eager = replace(impl, compile=False, compile_scope="model")
    if not family_of(model).compiled_rules:
        why = f"no compiled rules for {model.family}"
    else:
        try:
            estimate(model, step, impl, parallel, finetune=finetune)
            return impl
        except TrainmemError as exc:
            estimate(model, step, eager, parallel, finetune=finetune)  # an eager refusal is the user's to see
            why = str(exc).removeprefix("compile: ")
    answer = files[source]
    notes = [n for n in answer["notes"] if MAPPED not in n]  # the one line replaces compile_to's
    answer["notes"][:] = [*notes, f"compile set in {answer['path']}: estimated as eager, {why}; {TRACE_HINT}"]
    return eager


def hf_compile(get, impl: dict, notes: list[str]) -> None:
    # training_args.py, TrainingArguments.__post_init__: a backend or a mode turns torch_compile on, and no
    # backend is inductor; trainer.py, Trainer._build_accelerator_args: accelerate's TorchDynamoPlugin, whose
    # Accelerator.prepare_model runs torch.compile(model) on the whole model (no regional compilation)
    backend, mode = get("torch_compile_backend", str), get("torch_compile_mode", str)
    if not (get("torch_compile", bool) or backend is not None or mode is not None):
        return
    if backend not in (None, "inductor"):
        return compile_to(impl, notes, "torch_compile", None, f"backend {backend!r} is not inductor's partition")
    compile_to(impl, notes, "torch_compile", "model", "accelerate's prepare_model compiles the whole model")
    if mode in ("reduce-overhead", "max-autotune"):
        notes.append(f"torch_compile_mode={mode!r}: the CUDA graphs' private memory pool is not modelled")


def torchtitan_compile(get, impl: dict, notes: list[str], where: str) -> None:
    # config/job_config.py, Compile: components default ["model", "loss"], backend "inductor";
    # models/llama3/infra/parallelize.py: apply_compile compiles each TransformerBlock (after apply_ac) when
    # "model" is a component; components/loss.py, build_cross_entropy_loss: the loss when "loss" is one
    if not get("compile", "enable", bool, default=False):
        return
    components = get("compile", "components", list, default=False)
    components = ["model", "loss"] if components is None else components
    unknown = [c for c in components if c not in ("model", "loss")]
    if unknown:
        raise ConfigError(f"{where}: [compile] components={components!r}: {unknown[0]!r} is not model or loss")
    backend = get("compile", "backend", str, default=False) or "inductor"
    scope = None if "model" not in components else "block-loss" if "loss" in components else "block"
    why = ("each TransformerBlock compiled" + (", and the loss" if "loss" in components else "")
           if scope else "only the loss is compiled, which no --compile-scope models")
    if backend != "inductor":
        scope, why = None, f"backend {backend!r} is not inductor's partition"
    compile_to(impl, notes, "[compile] enable", scope, why)


def torchtune_compile(value: bool | dict | None, impl: dict, notes: list[str], where: str) -> None:
    """``compile``: a bool, or full_finetune_distributed's mapping (``model``, ``loss``, ``optimizer_step``,
    ``scale_grads``; ``FullFinetuneRecipeDistributed.__init__``: model and loss default true). The
    recipes call training.compile_model (each TransformerSelfAttentionLayer compiled alone) and
    training.compile_loss (torchtune/training/_compile.py)."""
    if not value:
        return
    parts = {"model": True, "loss": True, "optimizer_step": False, "scale_grads": True}
    if isinstance(value, dict):
        for key, on in value.items():
            if key not in parts:
                raise unknown_key(f"{where}: compile", str(key), parts)
            parts[key] = typed(where, f"compile.{key}", on, bool)
    scope = None if not parts["model"] else "block-loss" if parts["loss"] else "block"
    why = ("each TransformerSelfAttentionLayer compiled" + (", and the loss" if parts["loss"] else "")
           if scope else "only the loss is compiled, which no --compile-scope models")
    compile_to(impl, notes, "compile", scope, why)
    if parts["optimizer_step"]:
        notes.append("compile.optimizer_step: the compiled optimizer step's transients are not modelled")
