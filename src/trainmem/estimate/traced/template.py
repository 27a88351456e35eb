"""The traced template: every tensor one layer kind keeps, as exact polynomials in B and S.

:func:`build_template` traces the model cut to one period of its layer kinds
(:mod:`~trainmem.estimate.traced.kinds`) at six grid points and one held-out point
(:mod:`~trainmem.estimate.traced.record`), fits every saved tensor's axes and bytes
(:mod:`~trainmem.estimate.traced.poly`) and keeps, per layer kind, the tensors its first block
keeps, with the blocks of the full model that are of that kind. Parameters (exact shapes, from the
full model on the meta device) are kept the same way. A template is plain data: it is cached as
JSON (:mod:`~trainmem.estimate.traced.cache`) and evaluated at any (B, S) in its regime.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from fractions import Fraction
from typing import Any, Mapping, Sequence

from trainmem.errors import UnsupportedError
from trainmem.estimate.symbols import formula
from trainmem.estimate.traced import poly as P
from trainmem.inventory import Category, Inventory, MemoryItem, Repeat, dtype_bytes

__all__ = ["TracedItem", "Kind", "Template", "build_template", "regime_of", "seq_loops"]

_WINDOW_KEYS = ("sliding_window", "attention_chunk_size", "window_size", "local_window_size")


@dataclass(frozen=True)
class TracedItem:
    """One kept tensor: its name (relative to its block for a kind's items), creating op, dtype,
    one polynomial per axis and one for its storage bytes (:func:`poly.to_json` form: integer
    numerators over a common denominator), and the per-axis dims rendered from them."""

    name: str
    op: str
    dtype: str
    axes: tuple[tuple[int, ...], ...]
    nbytes: tuple[int, ...]
    dims: tuple[str, ...]

    @classmethod
    def fitted(cls, name: str, op: str, dtype: str, axes: Sequence[P.Poly], nbytes: P.Poly) -> "TracedItem":
        return cls(name, op, dtype, tuple(tuple(P.to_json(a)) for a in axes), tuple(P.to_json(nbytes)),
                   tuple(P.render(a) for a in axes))

    @cached_property
    def formula(self) -> str:
        return f"{formula(self.dims, dtype_bytes(self.dtype))} (aten.{self.op})"

    def at(self, B: int, S: int, prefix: str = "") -> MemoryItem:
        shape = tuple(P.value_int(a, B, S)[0] for a in self.axes)
        nbytes, rest = P.value_int(self.nbytes, B, S)
        if rest or nbytes < 0:
            raise UnsupportedError(f"--profile traced: {prefix}{self.name} has {P.value(P.from_json(self.nbytes), B, S)}"
                                   f" bytes at B={B}, S={S} (its fitted size is not whole there)")
        return MemoryItem.make(prefix + self.name, Category.ACTIVATION, shape, self.dtype, nbytes, self.formula,
                               self.dims)

    def to_json(self) -> list:
        return [self.name, self.op, self.dtype, [list(a) for a in self.axes], list(self.nbytes), list(self.dims)]

    @classmethod
    def from_json(cls, d: Sequence) -> "TracedItem":
        return cls(d[0], d[1], d[2], tuple(tuple(a) for a in d[3]), tuple(d[4]), tuple(d[5]))


@dataclass(frozen=True)
class Kind:
    """One layer kind of one stack: the blocks of that kind, and the tensors and parameters of one of them."""

    layers: tuple[int, ...]
    items: tuple[TracedItem, ...]
    params: tuple[tuple[str, tuple[int, ...]], ...]
    prefix: str  # its stack's blocks' names: "model.layers.", an encoder-decoder's "decoder.block."
    output: tuple[TracedItem, ...] = ()  # what the model's output holds of one such block (record._output_held)


@dataclass(frozen=True)
class Template:
    """Everything an estimate needs from the trace, independent of B and S (within ``regime``)."""

    model_type: str
    stacks: tuple[tuple[str, int], ...]  # each stack's blocks' names and depth: (("model.layers.", 32),)
    regime: tuple[int, int | None]  # S range the fit holds for: lo <= S < hi, hi None for no bound
    batch_one: bool  # fitted at B = 1 only (see poly.py), else for B >= 2
    base_items: tuple[TracedItem, ...]  # outside the blocks (embedding, final norm, loss, inputs)
    kinds: tuple[Kind, ...]
    params_before: tuple[tuple[str, tuple[int, ...]], ...]  # outside the blocks, before them
    params_after: tuple[tuple[str, tuple[int, ...]], ...]
    tp_plan: Mapping[str, str]
    traced_layers: int  # blocks in the traced cut, every stack's
    points: tuple[tuple[int, int], ...]
    held_items: tuple[TracedItem, ...] = ()  # an encoder-decoder's last stack's locals at its end (record._held)
    tp: int = 1  # traced at one tensor-parallel rank's shapes (traced/tp.py); parameters stay the full model's
    tp_div: Mapping[str, int] = field(default_factory=dict)  # tp > 1: each sharded parameter's divisor, by full name (tp.tp_divisors)

    def held_bytes(self, B: int, S: int) -> int:
        """What the last stack's scope holds at its end besides the kept tensors, at (B, S)."""
        return sum(i.at(B, S).bytes for i in self.held_items)

    def output_bytes(self, B: int, S: int) -> int:
        """What the model's output holds through the loss besides the kept tensors, at (B, S): each kind's block's
        share once per block of that kind in the full model (a cache entry per layer)."""
        return sum(len(k.layers) * sum(i.at(B, S).bytes for i in k.output) for k in self.kinds)

    def activations(self, B: int, S: int) -> Inventory:
        """The kept tensors at (B, S), each kind's block stored once as a template."""
        lo, hi = self.regime
        if not (S >= max(lo, 1) and (hi is None or S < hi)) or self.batch_one != (B == 1):
            raise UnsupportedError(f"--profile traced: B={B}, S={S} is outside the fitted range "
                                   f"(B {'= 1' if self.batch_one else '>= 2'}, {lo} <= S < {hi})")
        base = [i.at(B, S) for i in self.base_items]
        reps = []
        for k in self.kinds:
            src = k.layers[0]
            items = tuple(i.at(B, S, f"{k.prefix}{src}.") for i in k.items)
            reps.append(Repeat(items, k.prefix, src, k.layers, shift_previous=False))
        return Inventory(base, reps)

    def parameter_layout(self):
        """(before, [(kind params, layers, stack prefix)], after): parameter names and shapes."""
        return self.params_before, [(k.params, k.layers, k.prefix) for k in self.kinds], self.params_after

    def num_parameters(self) -> int:
        own = sum(math.prod(s) for _, s in (*self.params_before, *self.params_after))
        return own + sum(len(k.layers) * sum(math.prod(s) for _, s in k.params) for k in self.kinds)

    def to_json(self) -> dict:
        return {
            "model_type": self.model_type, "stacks": [list(st) for st in self.stacks],
            "regime": list(self.regime), "batch_one": self.batch_one, "base_items": [i.to_json() for i in self.base_items],
            "kinds": [{"layers": list(k.layers), "items": [i.to_json() for i in k.items],
                       "params": [[n, list(s)] for n, s in k.params], "prefix": k.prefix,
                       "output": [i.to_json() for i in k.output]} for k in self.kinds],
            "params_before": [[n, list(s)] for n, s in self.params_before],
            "params_after": [[n, list(s)] for n, s in self.params_after],
            "tp_plan": dict(self.tp_plan), "traced_layers": self.traced_layers,
            "points": [list(p) for p in self.points], "held_items": [i.to_json() for i in self.held_items],
            "tp": self.tp, "tp_div": dict(self.tp_div),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Template":
        def params(rows):
            return tuple((n, tuple(s)) for n, s in rows)
        return cls(
            d["model_type"], tuple((p, n) for p, n in d["stacks"]), (d["regime"][0], d["regime"][1]), d["batch_one"],
            tuple(TracedItem.from_json(i) for i in d["base_items"]),
            tuple(Kind(tuple(k["layers"]), tuple(TracedItem.from_json(i) for i in k["items"]), params(k["params"]),
                       k["prefix"], tuple(TracedItem.from_json(i) for i in k.get("output", ()))) for k in d["kinds"]),
            params(d["params_before"]), params(d["params_after"]), dict(d["tp_plan"]), d["traced_layers"],
            tuple(tuple(p) for p in d["points"]), tuple(TracedItem.from_json(i) for i in d.get("held_items", ())),
            d["tp"], dict(d["tp_div"]))


def regime_of(config: Mapping[str, Any], seq: int) -> tuple[int, int | None]:
    """The S range ``lo <= S < hi`` around ``seq`` in which no window of the config is reached:
    masks and kernels change there (transformers' ``masking_utils.py`` ``_ignore_causal_mask_sdpa``
    materializes the mask once ``kv_length >= local_attention_size``), so each side is fitted apart."""
    if seq_loops(config):
        return seq, seq + 1
    sizes = {k: config.get(k) for k in _WINDOW_KEYS}
    if config.get("model_type") == "modernbert" and isinstance(config.get("local_attention"), int):
        # ModernBertConfig.sliding_window is a property, local_attention // 2, and it is the mask's
        # local size (configuration_modernbert.py; masking_utils.py create_bidirectional_sliding_window_mask)
        sizes["sliding_window"] = config["local_attention"] // 2
    edges = sorted({v for v in sizes.values() if isinstance(v, int) and not isinstance(v, bool) and v > 0})
    lo = max((e for e in edges if e <= seq), default=0)
    hi = min((e for e in edges if e > seq), default=None)
    return lo, hi


def seq_loops(config: Mapping[str, Any]) -> str | None:
    """The layer type whose forward loops over chunks of the sequence, or None. Chunked linear
    attention pads S to a multiple of its chunk and runs one Python iteration per chunk, each
    keeping its own tensors: qwen3_next's gated delta rule (transformers ``modeling_qwen3_next.py``
    ``torch_chunk_gated_delta_rule``, ``chunk_size=64``) and MiniMax's lightning attention
    (``modeling_minimax.py`` ``MiniMaxLightningAttention.forward``, ``config.block_size``). What
    they keep is not a polynomial in S, so such a model is traced at the estimate's own S."""
    kinds = config.get("layer_types")
    if isinstance(kinds, (list, tuple)):
        return next((k for k in kinds if isinstance(k, str) and "linear" in k), None)
    return None


def _unit(config: Mapping[str, Any]) -> int:
    """The step between traced sequence lengths: 8, or a multiple that splits every expert's
    share of B·S·k evenly (the per-expert loop's counts are then exact)."""
    experts = next((config[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")
                    if isinstance(config.get(k), int) and config[k] > 0), 0)
    top_k = next((config[k] for k in ("num_experts_per_tok", "moe_topk", "top_k")
                  if isinstance(config.get(k), int) and config[k] > 0), 1)
    if not experts:
        return 8
    return math.lcm(8, experts // math.gcd(experts, top_k))


def _fit_points(config: Mapping[str, Any], regime: tuple[int, int | None],
                batch_one: bool) -> tuple[list, tuple[int, int]]:
    lo, hi = regime
    if hi == lo + 1:  # one S (seq_loops): traced there, fitted in B alone
        bs = (1,) if batch_one else (2, 3)
        return [(b, lo) for b in bs], (1 if batch_one else 4, lo)
    u = _unit(config)
    grid = list(P.grid_points((lo + u, lo + 2 * u, lo + 3 * u), (1,) if batch_one else (2, 3)))
    held = (1 if batch_one else 4, lo + 5 * u)
    if hi is not None and held[1] >= hi:
        raise UnsupportedError(f"--profile traced: the window at S={hi} is too close to the one at S={lo} "
                               f"to fit between them (it needs S up to {held[1]})")
    return grid, held


def _fit_items(runs: list[list], points: list[tuple[int, int]], held: tuple[int, int]) -> list[TracedItem]:
    """One :class:`TracedItem` per kept tensor, checked at the held-out point."""
    keys = [[(s.name, s.op, s.dtype, len(s.shape)) for s in run] for run in runs]
    for k, run_keys in enumerate(keys[1:], 1):
        if run_keys != keys[0]:
            diff = next((a, b) for a, b in zip(keys[0] + [None], run_keys + [None]) if a != b)
            raise UnsupportedError(f"--profile traced: what the model keeps changes with B and S "
                                   f"({points[0]} vs {(points + [held])[k]}: {diff[0] and diff[0][0]} / "
                                   f"{diff[1] and diff[1][0]}); it cannot be fitted")
    grid_runs, check = runs[:-1], runs[-1]
    out = []
    for j, first in enumerate(grid_runs[0]):
        axes = tuple(P.fit(points, [r[j].shape[a] for r in grid_runs]) for a in range(len(first.shape)))
        nbytes = P.fit(points, [r[j].nbytes for r in grid_runs])
        want = check[j]
        got_shape = tuple(P.value(a, *held) for a in axes)
        if got_shape != tuple(Fraction(x) for x in want.shape) or P.value(nbytes, *held) != want.nbytes:
            raise UnsupportedError(f"--profile traced: {first.name} is not a polynomial in B and S of degree "
                                   f"<= 1 in B and <= 2 in S (fitted {P.render(nbytes)} bytes, but at B={held[0]}, "
                                   f"S={held[1]} it holds {want.nbytes} of shape {want.shape})")
        out.append(TracedItem.fitted(first.name, first.op, first.dtype, axes, nbytes))
    return out


def _same(a: Sequence[TracedItem], b: Sequence[TracedItem]) -> bool:
    return [(i.name, i.op, i.dtype, i.axes, i.nbytes) for i in a] == [(i.name, i.op, i.dtype, i.axes, i.nbytes)
                                                                       for i in b]


def _cut_length(sigs: list[tuple], first: dict[tuple, int]) -> int:
    """Blocks to trace: every kind, one repeat (the check), and last a block of the full model's
    last block's kind (the last block's output is kept, or not, by what follows it: the final
    norm). The whole model when that is not shorter."""
    depth = len(sigs)
    cut = max(first.values()) + 3
    while cut < depth and sigs[cut - 1] != sigs[-1]:
        cut += 1
    return min(cut, depth)


def build_template(config: Mapping[str, Any], step, impl, tp: int = 1, sp: bool = False,
                   loss_parallel: bool = True) -> Template:
    """Trace, fit and check (see the module docstring). ``step.seq`` picks the regime. An
    encoder-decoder's two stacks are cut, split into kinds and checked each on its own, in one trace.
    ``tp`` > 1: the cut model is traced at one rank's shapes (:mod:`.tp`)."""
    from trainmem.estimate.traced import kinds as K
    from trainmem.estimate.traced.record import record_saved

    full = K.meta_model(config, impl.attention)
    stacks = K.find_stacks(full)
    if len(stacks) > 1 and impl.recompute == "every-k":
        raise UnsupportedError(f"--profile traced: {config['model_type']} has two stacks of blocks, counted as one by "
                               "--recompute every-k (a cut shifts the decoder's count); use --recompute full")
    sigs = [K.layer_signatures(full, st, impl.checkpointed) for st in stacks]
    firsts: list[dict[tuple, int]] = [{} for _ in stacks]
    kind_of = [[f.setdefault(s, i) for i, s in enumerate(sg)] for f, sg in zip(firsts, sigs)]  # block -> its kind's first
    cuts = tuple(_cut_length(sg, f) for sg, f in zip(sigs, firsts))
    small = K.reduced_stacks_config(config, stacks, cuts)
    cut_model = K.meta_model(small, impl.attention)
    cut_stacks = K.find_stacks(cut_model)
    if [c.prefix for c in cut_stacks] != [st.prefix for st in stacks] or any(
            K.layer_signatures(cut_model, c, impl.checkpointed) != sg[:n] for c, sg, n in zip(cut_stacks, sigs, cuts)):
        raise UnsupportedError(f"--profile traced: {config['model_type']} cut to its first {'/'.join(map(str, cuts))} "
                               "blocks does not build the same blocks (its layer pattern is not read from its "
                               "depth keys and per-layer lists)")
    regime = regime_of(config, step.seq)
    batch_one = step.batch == 1
    grid, held = _fit_points(config, regime, batch_one)
    plan = K.tp_plan_of(full)
    prepare = None
    if tp > 1:
        from functools import partial

        from trainmem.estimate.traced import tp as T
        prepare = partial(T.localize, plan=plan, tp=tp, sp=sp, loss_parallel=loss_parallel)
    runs = record_saved(small, step, impl, grid + [held], prepare=prepare)
    base, per_layer = _by_block(_fit_items([[s for s in r if not (s.held or s.output)] for r in runs], grid, held),
                                stacks, cuts)
    held_items = _fit_items([[s for s in r if s.held] for r in runs], grid, held)
    # what the output holds of each block; not what the model made outside them: the cut model's count, not the full
    # one's (Gemma3's cache makes a (8 B) sliding-window tensor per sliding layer in the model's forward: left out)
    _, out_layer = _by_block(_fit_items([[s for s in r if s.output] for r in runs], grid, held), stacks, cuts)

    shapes = K.parameter_shapes_of(full)
    in_any = [(n, s) for n, s in shapes if any(n.startswith(st.prefix) for st in stacks)]
    at = shapes.index(in_any[0]) if in_any else len(shapes)
    before = tuple(p for p in shapes[:at] if p not in in_any)
    after = tuple(p for p in shapes[at:] if p not in in_any)
    kinds = [kind for k, st in enumerate(stacks)
             for kind in _stack_kinds(config, st, cuts[k], kind_of[k], firsts[k], in_any,
                                      {i: per_layer[(k, i)] for i in range(cuts[k])},
                                      {i: out_layer[(k, i)] for i in range(cuts[k])})]
    return Template(config["model_type"], tuple((st.prefix, st.num_layers) for st in stacks), regime, batch_one,
                    tuple(base), tuple(kinds), before, after, plan, sum(cuts), tuple(grid) + (held,), tuple(held_items),
                    tp, T.tp_divisors(full, plan, tp) if tp > 1 else {})


def _by_block(items: list[TracedItem], stacks, cuts) -> tuple[list[TracedItem], dict[tuple[int, int], list]]:
    """``items`` outside the blocks, and those of each traced block (stack, index) named relative to it."""
    per_layer: dict[tuple[int, int], list[TracedItem]] = {(k, i): [] for k, n in enumerate(cuts) for i in range(n)}
    base = []
    for it in items:
        k = next((k for k, st in enumerate(stacks) if it.name.startswith(st.prefix)), None)
        idx, _, tail = it.name[len(stacks[k].prefix):].partition(".") if k is not None else ("", "", "")
        if idx.isdigit() and tail:
            per_layer[(k, int(idx))].append(TracedItem(tail, it.op, it.dtype, it.axes, it.nbytes, it.dims))
        else:
            base.append(it)
    return base, per_layer


def _stack_kinds(config, stack, cut: int, kind_of: list[int], first: dict[tuple, int], shapes: list,
                 per_layer: dict[int, list[TracedItem]], output: dict[int, list[TracedItem]]) -> list[Kind]:
    """One stack's kinds: each kind's first block's tensors and parameters, checked on a repeat; ``output``:
    what the model's output holds of each traced block (record._output_held), taken from the same block."""
    depth = stack.num_layers

    def params_of(block: int) -> tuple:
        pre = f"{stack.prefix}{block}."
        return tuple((n[len(pre):], s) for n, s in shapes if n.startswith(pre))

    if cut == depth:  # the whole stack was traced: every block is its own
        return [Kind((i,), tuple(per_layer[i]), params_of(i), stack.prefix, tuple(output[i])) for i in range(depth)]
    check = cut - 2  # a block past the first of its kind, followed by another block
    if not _same(per_layer[check], per_layer[kind_of[check]]):
        raise UnsupportedError(f"--profile traced: block {check} of {config['model_type']}'s {stack.prefix[:-1]} keeps "
                               f"other tensors than block {kind_of[check]}, of the same kind; blocks are not alike")
    kinds = [Kind(tuple(i for i in range(depth - 1) if kind_of[i] == src), tuple(per_layer[src]), params_of(src),
                  stack.prefix, tuple(output[src])) for src in sorted(first.values())]
    kinds = [k for k in kinds if k.layers]
    kinds.append(Kind((depth - 1,), tuple(per_layer[cut - 1]), params_of(kind_of[-1]), stack.prefix,
                      tuple(output[cut - 1])))
    return kinds
