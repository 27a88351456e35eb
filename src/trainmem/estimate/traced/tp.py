"""Tensor parallelism under ``--profile traced``: the cut model is traced at one rank's shapes.

The blocks are cut as transformers' ``base_model_tp_plan`` says (``Template.tp_plan``), each
style as transformers' DTensor styles run in training (transformers ``distributed/tensor_parallel.py``,
the ``ALL_PARALLEL_STYLES`` registrations; torch ``distributed/tensor/placement_types.py``):

* ``colwise``: ``ColwiseParallel(input Replicate, output Shard(-1))``: weight and bias ``Shard(0)``,
  so the rank's linear has ``out_features / tp`` rows and its output is the rank's slice (the
  heads that follow are ``A / tp``: transformers' attention reshapes with ``-1`` heads);
* ``colwise_rep`` / ``colwise_gather_output``: the same shard, its output all-gathered to the full
  width (``Shard(-1) -> Replicate``: a new tensor; the redistribute saves nothing for backward);
* ``rowwise``: ``RowwiseParallel(input Shard(-1), output Replicate)``: weight ``Shard(-1)``
  (``in_features / tp`` columns), bias replicated; the partial output is all-reduced into a new
  tensor of the same shape, which nothing saves;
* ``rowwise_split_input`` / ``rowwise_rep``: the same, its replicated input cut to the rank's
  slice first (``Shard._replicate_to_shard``: a chunk, cloned, so the linear saves a new tensor);
* ``replicated_with_grad_allreduce`` / ``replicate``: every rank keeps the whole parameter.

The embedding and the output layer follow trainmem's TP layout, as under ``--profile hf``
(torchtitan's ``apply_tp``: a vocab-parallel embedding, a column-parallel head whose logits stay
vocab-sharded for the loss-parallel cross-entropy): each rank's tables have ``⌈V/tp⌉`` rows and its
loss runs on its own ``⌈V/tp⌉`` logits (``estimate/loss_parallel.py``). transformers' own
``_tp_plan`` (a replicated embedding, ``lm_head: colwise_gather_output``) is not modelled.

``--no-loss-parallel`` (gathered logits): the rank's V/tp logits are all-gathered along the
vocabulary (``Shard(-1) -> Replicate``: a new tensor) and the loss reads all V of them.

Sequence parallelism (``--sp``, torchtitan's layout, as the hf rules model it; no transformers
plan names it): the residual stream between the plan's parallel regions holds S/tp tokens. The
embedding's output is cut to the rank's S/tp tokens (its reduce-scatter: a new tensor, handed to
the first block; the model's masks and positions are made from the full output, as DTensor's
global shape gives them), the input of each module holding a column-cut linear (``self_attn``, ``mlp``)
is all-gathered along S (``PrepareModuleInput``: a new tensor, which those linears save), each
row-cut linear's output is reduce-scattered to S/tp (a new tensor), and the output layer's input
is gathered. Norms and residual adds then run on S/tp tokens.

What is kept is then read off the rank's own forward (``record.py``) and fitted as on one device;
its model states are the full model's, each divided by ``tp`` where the plan shards it
(:func:`tp_divisors`), through the same parallel driver as every profile (``estimate/parallel.py``).
Any other style (MoE experts, packed projections, MLA) is refused in one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Mapping

from trainmem.errors import SpecError, UnsupportedError

__all__ = ["Style", "STYLES", "module_styles", "localize", "tp_divisors", "check_tp_layout", "traced_rank_parts"]


@dataclass(frozen=True)
class Style:
    """What one transformers TP style does to a module on one rank."""

    cut: str | None  # "out": rows (output features) / tp; "in": columns (input features) / tp; None: replicated
    gather_output: bool = False  # the rank's output slice is all-gathered to the full width
    split_input: bool = False  # a replicated input is cut to the rank's slice (a clone)
    bias_cut: bool = False  # the bias is sharded with the rows (colwise); rowwise biases are replicated


STYLES: dict[str, Style] = {  # transformers distributed/tensor_parallel.py, ALL_PARALLEL_STYLES
    "colwise": Style("out", bias_cut=True),
    "colwise_rep": Style("out", gather_output=True, bias_cut=True),
    "colwise_gather_output": Style("out", gather_output=True, bias_cut=True),
    "rowwise": Style("in"),
    "rowwise_split_input": Style("in", split_input=True),
    "rowwise_rep": Style("in", split_input=True),
    "replicated_with_grad_allreduce": Style(None),
    "replicate": Style(None),
}
VOCAB = Style("vocab")  # the embedding and the output layer: ⌈V/tp⌉ rows (trainmem's TP layout)


def _wildcard(name: str) -> str:
    """A module name with its block indices as ``*`` (transformers ``parallel_utils.py``
    ``replace_layer_number_by_wildcard``: a number between dots, or after the last dot)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def module_styles(model, plan: Mapping[str, str]) -> dict[str, Style]:
    """Each module the plan (as ``kinds.tp_plan_of`` prefixes it) or the vocab layout cuts, by name."""
    if not plan:
        raise UnsupportedError(f"--profile traced --tp: model_type={model.config.model_type!r} has no "
                               "base_model_tp_plan in transformers; its tensor-parallel cut is unknown")
    bad = sorted({s for s in plan.values() if s not in STYLES})
    if bad:
        raise UnsupportedError(f"--profile traced --tp: model_type={model.config.model_type!r}'s tp plan uses "
                               f"{', '.join(bad)}, not modelled (only {', '.join(STYLES)})")
    modules = dict(model.named_modules())
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    named_params = sorted(k for k in plan if k not in modules and any(_wildcard(p) == k for p in params))
    if named_params:
        raise UnsupportedError(f"--profile traced --tp: the tp plan shards parameters by name ({named_params[0]}), "
                               "not modelled")
    out = {n: STYLES[plan[_wildcard(n)]] for n in modules if n and _wildcard(n) in plan}
    for emb in (model.get_input_embeddings(), model.get_output_embeddings()):
        name = next((n for n, m in modules.items() if m is emb), None) if emb is not None else None
        if name is not None:
            out[name] = VOCAB
    return out


def _local_shape(shape: tuple[int, ...], style: Style, tp: int, bias: bool, where: str) -> tuple[int, ...]:
    if style.cut == "vocab":
        return (-(-shape[0] // tp),) + tuple(shape[1:])
    if style.cut is None or (bias and not style.bias_cut):
        return tuple(shape)
    dim = 0 if (style.cut == "out" or bias) else len(shape) - 1
    if shape[dim] % tp:
        raise SpecError("tp", tp, f"must divide {where}'s {'output' if dim == 0 else 'input'} features ({shape[dim]})")
    return tuple(s // tp if d == dim else s for d, s in enumerate(shape))


def localize(model, plan: Mapping[str, str], tp: int, sp: bool = False, loss_parallel: bool = True) -> None:
    """Make ``model`` (built under a ``FakeTensorMode``) one TP rank's: every parameter the plan
    or the vocab layout cuts gets its local shape (tied weights stay tied), gathered outputs and
    split inputs get forward hooks, and the loss reads the rank's ``⌈V/tp⌉`` logits (all V
    without ``loss_parallel``). ``sp``: the sequence-parallel hooks (:func:`_sequence_parallel`)."""
    import torch

    styles = module_styles(model, plan)
    new: dict[int, Any] = {}
    for name, style in styles.items():
        mod = model.get_submodule(name)
        for pname, p in list(mod.named_parameters(recurse=False)):
            if id(p) not in new:
                shape = _local_shape(tuple(p.shape), style, tp, pname == "bias", f"{name}.{pname}")
                new[id(p)] = torch.nn.Parameter(torch.empty(shape, dtype=p.dtype, device=p.device),
                                                requires_grad=p.requires_grad)
        if style.gather_output:
            mod.register_forward_hook(lambda _m, _a, out: torch.cat([out] * tp, dim=-1))
        if style.split_input:
            mod.register_forward_pre_hook(
                lambda _m, args: (args[0].narrow(-1, 0, args[0].shape[-1] // tp).contiguous(),) + tuple(args[1:]))
    for mod in model.modules():  # every holder of a cut parameter (tied embedding and head alike)
        for pname, p in list(mod.named_parameters(recurse=False)):
            if id(p) in new:
                setattr(mod, pname, new[id(p)])
        _local_padding(mod)
    head = model.get_output_embeddings()
    if loss_parallel and hasattr(model.config, "vocab_size"):  # the loss's view(-1, vocab_size) of the rank's logits
        model.config.vocab_size = -(-model.config.vocab_size // tp)
    elif head is not None:  # gathered logits: the rank's B·S·V/tp, all-gathered along the vocabulary
        if head.weight.shape[0] * tp != getattr(model.config, "vocab_size", 0):
            raise SpecError("tp", tp, f"must divide the vocabulary ({model.config.vocab_size}) for gathered logits "
                                      "(--no-loss-parallel) under --profile traced")
        head.register_forward_hook(lambda _m, _a, out: torch.cat([out] * tp, dim=-1))
    if sp:
        _sequence_parallel(model, styles, tp, torch)


def _local_padding(mod) -> None:
    """A vocabulary-cut embedding's ``padding_idx`` beyond its local rows (OLMo-2's 100277 on 50,176 rows at tp 2)
    is dropped. torch's TP keeps the full index on a DTensor weight whose size is the global one
    (``torch/nn/functional.py`` ``embedding`` checks it against ``weight.size(0)``); the local lookup runs on
    masked local ids (``torch/distributed/tensor/_ops/_embedding_ops.py``, ``placement_types.py``
    ``MaskPartial._mask_tensor``), and the index only zeroes a row of the gradient in
    ``embedding_dense_backward``: no byte depends on it, so the local fake module need not carry it."""
    pad = getattr(mod, "padding_idx", None)
    weight = getattr(mod, "weight", None)
    if pad is not None and weight is not None and getattr(mod, "num_embeddings", None) is not None \
            and not -weight.shape[0] <= pad < weight.shape[0]:
        mod.padding_idx = None


def _sequence_parallel(model, styles: Mapping[str, Style], tp: int, torch) -> None:
    from trainmem.estimate.traced.kinds import find_stacks

    def scatter(x):
        if x.shape[1] % tp:
            raise SpecError("tp", tp, f"sequence parallelism needs tp to divide the traced S={x.shape[1]}")
        return x.narrow(1, 0, x.shape[1] // tp).clone()

    def gather(x):
        return torch.cat([x] * tp, dim=1)

    def on_input(fn):  # a forward pre-hook applying fn to the hidden states, positional or keyword
        def hook(_m, args, kwargs):
            if args:
                return (fn(args[0]),) + tuple(args[1:]), kwargs
            key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
            return args, {**kwargs, key: fn(kwargs[key])}
        return hook

    stacks = find_stacks(model)
    if len(stacks) > 1:
        raise SpecError("sp", True, "sequence parallelism is not modelled for an encoder-decoder under --profile traced")
    blocks = stacks[0].prefix
    # the embedding's reduce-scatter, made as it returns (outside the blocks, as its own tensor), and
    # handed to the first block in place of the full output the model made its masks and positions from
    cut: dict[str, Any] = {}
    model.get_input_embeddings().register_forward_hook(lambda _m, _a, out: cut.__setitem__("x", scatter(out)))
    model.get_submodule(blocks + "0").register_forward_pre_hook(
        on_input(lambda x: cut.pop("x") if "x" in cut else x), with_kwargs=True)
    parents = sorted({n.rpartition(".")[0] for n, st in styles.items() if st.cut == "out"})
    for name in parents:
        if name.startswith(blocks) and name[len(blocks):].isdigit():
            raise SpecError("sp", True, f"{name} holds column-cut linears itself: its sequence-parallel input is not "
                                        "modelled under --profile traced")
        model.get_submodule(name).register_forward_pre_hook(on_input(gather), with_kwargs=True)
    for name, st in styles.items():
        if st.cut == "in":
            model.get_submodule(name).register_forward_hook(lambda _m, _a, out: scatter(out))
    head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(on_input(gather), with_kwargs=True)


def tp_divisors(model, plan: Mapping[str, str], tp: int) -> dict[str, int]:
    """Each parameter the cut shards, by its full-model name: ``tp`` (the driver divides its
    states by it, as ``parallel_tp._tp_factor`` does for the hf rules' roles)."""
    styles = module_styles(model, plan)
    out = {}
    for name, style in styles.items():
        for pname, p in model.get_submodule(name).named_parameters(recurse=False):
            if p.requires_grad and _local_shape(tuple(p.shape), style, tp, pname == "bias", name) != tuple(p.shape):
                out[f"{name}.{pname}"] = tp
    return out


def check_tp_layout(par) -> None:
    """Refuse, in one line, the layouts ``--profile traced`` does not model: it models ``--tp`` alone."""
    if par.tp == 1:
        raise SpecError("profile", "traced", "is modelled on one device or with --tp alone (no --dp/--pp/--cp/--ep/"
                                             "--zero/--fsdp/--offload) for now")
    for field, value, ok in (("dp", par.dp, 1), ("pp", par.pp, 1), ("cp", par.cp, 1), ("ep", par.ep, 1),
                             ("zero", par.zero, 0), ("fsdp", par.fsdp, None), ("offload", par.offload, ())):
        if value != ok and not (field == "offload" and not value):
            raise SpecError(field, value, "is not modelled under --profile traced with --tp (it models --tp alone)")


def _divisor(state: str, div: Mapping[str, int]) -> int:
    """A model state's divisor: its parameter's (``<param>``, ``<param>.grad``, ``<param>.exp_avg``...)."""
    name = state
    while name:
        if name in div:
            return div[name]
        name = name.rpartition(".")[0]
    return 1
