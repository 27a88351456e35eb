"""``--profile traced``: an estimate derived from a fake-tensor trace, for any architecture that
transformers builds, with no hand-written rules.

1. The model is built on the meta device; its blocks are grouped into layer kinds
   (:mod:`.kinds`) and the config is cut to one period of them plus one block.
2. The cut model's forward runs on CPU fake tensors at six (B, S) grid points and one held-out
   point, at the model's real width (:mod:`.record`); every tensor it keeps for backward is fitted
   exactly as a polynomial in B and S, per axis and in bytes, and checked (:mod:`.poly`,
   :mod:`.template`).
3. One template per layer kind is kept, with the parameters' exact shapes; it is cached on disk
   (:mod:`.cache`). Model states come from the shared model-state code, then the usual phases.

Known limitations (each refused in one line):
  - CPU kernels only: ``--device cpu``. CUDA's attention kernels save other tensors.
  - One device or ``--tp`` alone (:mod:`.tp`: the blocks cut by transformers' ``base_model_tp_plan``,
    traced at one rank's shapes, also --sp); no --dp/--pp/--cp/--ep/--zero/--fsdp, no fine-tuning, no
    --compile, train mode.
  - An encoder-decoder (T5, BART) is traced as its head runs in ``trainmem trace``: ``labels`` are
    the input ids, so the decoder reads S tokens too (one S for both stacks); no --recompute every-k.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping

from trainmem.errors import SpecError, UnsupportedError
from trainmem.inventory import Inventory, Repeat, dtype_bytes

__all__ = ["traced_template", "traced_parts", "traced_stack_held", "traced_output_held", "traced_stacks",
           "traced_model_spec", "unmapped_model_spec", "check_traced"]

_MEMO: dict[str, Any] = {}  # key -> Template, for sweeps within one process
_CONFIGS: dict[Any, dict] = {}  # ModelSpec named "" -> the config.json it was read from (unmapped_model_spec)


def check_traced(step, impl, parallel=None, finetune=None) -> None:
    """Refuse, in one line, what ``--profile traced`` does not model."""
    if impl.device != "cpu":
        raise SpecError("device", impl.device, "--profile traced traces CPU kernels: add --device cpu "
                                               "(CUDA's attention kernels save other tensors)")
    if impl.compile:
        raise SpecError("compile", True, "is not traced by --profile traced; use --profile hf")
    if parallel is not None and not parallel.is_single:  # --tp alone: traced at one rank's shapes (tp.py)
        from trainmem.estimate.traced.tp import check_tp_layout
        check_tp_layout(parallel)
    if finetune is not None:
        raise SpecError("profile", "traced", "fine-tuning (LoRA, QLoRA, --freeze) is modelled under --profile hf only")
    if step.mode != "train":
        raise SpecError("mode", step.mode, "--profile traced estimates training steps")
    if step.loss != "ce":
        raise SpecError("loss", step.loss, "--profile traced runs Hugging Face's loss: use --loss ce")


def _settings(step, impl, regime, tp: int = 1, sp: bool = False, loss_parallel: bool = True) -> dict:
    layout = {"tp": tp, "sp": sp, "loss_parallel": loss_parallel} if tp > 1 else {}
    return {**layout, "precision": step.precision, "loss": step.loss, "attention": impl.attention,
            "recompute": impl.recompute, "recompute_every": impl.recompute_every, "device": impl.device,
            **({"recompute_from": impl.recompute_from} if impl.recompute == "every-k" else {}),
            "routing": impl.routing, "regime": list(regime), "batch_one": step.batch == 1}


def traced_template(config: Mapping[str, Any], step, impl, tp: int = 1, sp: bool = False,
                    loss_parallel: bool = True):
    """The :class:`~.template.Template` for ``config`` under ``step`` and ``impl`` (any B; S picks
    the regime), traced at one of ``tp`` tensor-parallel ranks' shapes (``sp``, ``loss_parallel``:
    :mod:`.tp`): from memory, from the disk cache, or traced now."""
    from trainmem.estimate.traced.cache import cache_key, cached
    from trainmem.estimate.traced.template import Template, build_template, regime_of

    regime = regime_of(config, step.seq)
    key = cache_key(config, _settings(step, impl, regime, tp, sp, loss_parallel))
    hit = _MEMO.get(key)
    if hit is not None:
        return hit
    def build() -> dict:
        from trainmem.estimate.traced.imports import import_transformers_models
        import_transformers_models()
        return build_template(config, step, impl, tp, sp, loss_parallel).to_json()

    data, _ = cached(key, build)
    tpl = Template.from_json(data)
    _MEMO[key] = tpl
    return tpl


def _state_inventory(tpl, step, fp32=None) -> Inventory:
    """``fp32``: the parameters a 16-bit load keeps in fp32 (``estimate/params.py`` ``kept_fp32``)."""
    from trainmem.estimate.model_states import _items_for

    before, kinds, after = tpl.parameter_layout()
    base = _items_for(list(before), step, fp32) + _items_for(list(after), step, fp32)
    reps = []
    for params, layers, prefix in kinds:
        pre = f"{prefix}{layers[0]}."
        reps.append(Repeat(tuple(_items_for([(pre + n, s) for n, s in params], step, fp32)), prefix, layers[0],
                           layers, shift_previous=False))
    return Inventory(base, reps)


def _optimizer_transient(tpl, step, impl) -> tuple[int, str]:
    """As ``model_states.optimizer_step_transient_bytes``: every parameter's total, and the sizes
    of the parameters outside the blocks and of one block per kind (neighbours and the largest)."""
    from trainmem.estimate.optimizer_step import Stepped, recipe_transient

    before, kinds, after = tpl.parameter_layout()
    sb = dtype_bytes(step.dtypes.state)
    sizes = [math.prod(s) for _, s in before] + [math.prod(s) for params, *_ in kinds for _, s in params] \
        + [math.prod(s) for _, s in after]
    stepped = Stepped(int(tpl.num_parameters() * sb), tuple(int(n * sb) for n in sizes), sb)
    return recipe_transient(step, impl, stepped, stepped.total_bytes if step.dtypes.master else 0)


def _config_of(model) -> dict:
    """The config.json the ModelSpec was read from (``model.name``: a preset, a path, ORG/NAME)."""
    from trainmem.errors import ConfigError
    from trainmem.specs.loaders import load_config_dict

    known = _CONFIGS.get(replace(model, name=""))  # commands that rebuild the spec from the dict (sweep)
    if known is not None:
        return known
    try:
        return load_config_dict(model.name)
    except ConfigError:
        raise SpecError("model", model.name, "--profile traced builds the model from its config.json: name a "
                                             "preset, a config.json or a model folder") from None


def traced_parts(model, step, impl, parallel=None, finetune=None):
    """(activations, model states, activations without recompute or None, optimizer temporaries)
    for :func:`trainmem.estimate.estimate` under ``--profile traced``."""
    check_traced(step, impl, parallel, finetune)
    config = _config_of(model)
    if traced_model_spec(config, name=model.name) != model:
        raise SpecError("profile", "traced", f"traces {model.name}'s config.json as written; model fields set "
                                             "on top of it (from files or code) are not applied")
    tpl = traced_template(config, step, impl)
    acts = tpl.activations(step.batch, step.seq)
    plain = None
    if impl.recompute != "none":
        plain = traced_template(config, step, replace(impl, recompute="none", recompute_every=1)) \
            .activations(step.batch, step.seq)
    from trainmem.estimate.params import kept_fp32
    return acts, _state_inventory(tpl, step, kept_fp32(model)), plain, _optimizer_transient(tpl, step, impl)


def traced_stack_held(model, step, impl) -> int:
    """Bytes an encoder-decoder's last stack holds at its end besides the kept tensors (its
    locals: T5's position biases, the KV cache it returns; ``record._held``); 0 for one stack.
    The template is the one :func:`traced_parts` traced (memoized)."""
    return traced_template(_config_of(model), step, impl).held_bytes(step.batch, step.seq)


def traced_output_held(model, step, impl) -> int:
    """Bytes the model's output holds through the loss besides the kept tensors (a cache's entries that no
    gradient reads, and what their graph saved: MiniMax's lightning-attention state, ``record._output_held``),
    the forward phase's ``kv_cache_unsaved`` under ``--profile traced`` (estimate/forward_held.py)."""
    return traced_template(_config_of(model), step, impl).output_bytes(step.batch, step.seq)


def traced_stacks(model, step, impl) -> tuple[tuple[str, int], ...]:
    """The traced template's stacks of blocks (``Template.stacks``: each stack's blocks' prefix and
    depth), by which ``estimate/peak.py`` numbers blocks; the template :func:`traced_parts` traced."""
    return traced_template(_config_of(model), step, impl).stacks


_GENERIC_KEYS = {  # ModelSpec field -> config keys, first present wins
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "head_dim": ("head_dim",),
    "ffn_size": ("intermediate_size", "ffn_dim", "d_ff", "n_inner", "moe_intermediate_size",
                 "encoder_ffn_dim"),
    "vocab_size": ("vocab_size",),
    "max_positions": (),
}


def traced_model_spec(config: Mapping[str, Any], name: str = "custom"):
    """The ModelSpec shown beside a traced estimate: the estimator's own reading of a model type it
    maps, else a generic one from the config's sizes (display, defaults and the logits' width only:
    what is kept and every parameter come from the trace)."""
    from trainmem.specs import ModelSpec
    from trainmem.specs.loaders import SUPPORTED_MODEL_TYPES, spec_from_hf_config

    if config.get("model_type") in SUPPORTED_MODEL_TYPES:
        return spec_from_hf_config(config, name=name)
    got: dict[str, Any] = {}
    for field, keys in _GENERIC_KEYS.items():
        value = next((config[k] for k in keys if isinstance(config.get(k), int) and config[k] > 0), None)
        if value is not None:
            got[field] = value
    missing = [f for f in ("hidden_size", "num_layers", "num_heads", "vocab_size") if f not in got]
    if missing:
        raise UnsupportedError(f"{name}: model_type={config.get('model_type')!r} config writes no "
                               f"{', '.join(missing)}; --profile traced needs the sizes in the file")
    got.setdefault("ffn_size", 4 * got["hidden_size"])
    if "head_dim" not in got and got["hidden_size"] % got["num_heads"]:
        got["head_dim"] = 1  # display only: the trace has the real shapes
    if got.get("num_kv_heads") and got["num_heads"] % got["num_kv_heads"]:
        del got["num_kv_heads"]
    try:
        return ModelSpec(name=name, family="generic", tied_embeddings=bool(config.get("tie_word_embeddings")),
                         **got)
    except SpecError as exc:
        raise UnsupportedError(f"{name}: model_type={config.get('model_type')!r}: {exc}") from None


def unmapped_model_spec(name: str):
    """For ``--model NAME --profile traced``: the generic ModelSpec of a model type the estimator
    does not map, or None (the usual reading applies). Either way the config is remembered for the
    spec, so a command that passes the spec on under another name still finds it."""
    from trainmem.specs.loaders import SUPPORTED_MODEL_TYPES, load_config_dict

    config = load_config_dict(name)
    spec = traced_model_spec(config, name=name)
    _CONFIGS[replace(spec, name="")] = config
    return None if config.get("model_type") in SUPPORTED_MODEL_TYPES else spec


def traced_rank_parts(model, step, impl, par):
    """For ``estimate/parallel.py`` ``rank_classes`` under ``--profile traced --tp``: (activations,
    their stages, recompute per block), (model states, their stages, TP divisors) and the
    optimizer step's temporaries, from the template traced at one rank's shapes."""
    from trainmem.estimate.params import kept_fp32
    from trainmem.estimate.peak import recompute_per_layer
    from trainmem.estimate.traced.tp import _divisor, check_tp_layout

    check_tp_layout(par)
    config = _config_of(model)
    layout = dict(tp=par.tp, sp=par.sp, loss_parallel=par.loss_parallel)
    tpl = traced_template(config, step, impl, **layout)
    if len(tpl.stacks) > 1:
        raise SpecError("tp", par.tp, f"an encoder-decoder ({tpl.model_type}) is modelled on one device only "
                                      "under --profile traced")
    acts = tpl.activations(step.batch, step.seq)
    plain = acts
    if impl.recompute != "none":
        plain = traced_template(config, step, replace(impl, recompute="none", recompute_every=1), **layout) \
            .activations(step.batch, step.seq)
    items = tuple(acts)
    recompute = recompute_per_layer(acts, plain, tpl.stacks)
    states = tuple(_state_inventory(tpl, step, kept_fp32(model)))
    div = {s.name: _divisor(s.name, tpl.tp_div) for s in states}
    return ((items, (0,) * len(items), recompute), (states, {s.name: 0 for s in states}, div),
            _optimizer_transient(tpl, step, impl), tuple(plain))
