"""Small results for the report tests: a tiny estimate and hand-written dicts in each schema."""

from __future__ import annotations

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

TINY = ModelSpec(name="tiny", family="generic", hidden_size=8, num_layers=2, num_heads=2, ffn_size=16, vocab_size=32)


def tiny_estimate(**step):
    return estimate(TINY, StepSpec(**{"batch": 1, "seq": 4, "precision": "fp32", **step}), ImplSpec())


GIB = 2**30

SWEEP = {
    "schema": "trainmem.sweep/2", "over": "seq", "backend": "estimate", "budget_bytes": 80 * GIB, "max_fit": 12288,
    "points": [{"value": s, "fits": s <= 12288, "peak_bytes": 20 * GIB + s * s * 256 + s * 2**20,
                "totals_bytes": {"parameter": 15 * GIB, "activation": s * s * 256 + s * 2**20}}
               for s in (1024, 2048, 4096, 8192, 16384)],
    "fit": {"peak": {"exponent": 1.7, "quadratic_coef": 256.0, "linear_coef": float(2**20),
                     "constant": float(20 * GIB), "num_points": 5}},
    "verdict": "quadratic", "crossover_seq": 4096.0,
}

PLAN = {
    "schema": "trainmem.plan/2",
    "inputs": {"model": {"name": "llama-3-70b", "source": "preset"}, "step": {"seq": 4096}, "global_batch": 512,
               "gpu": {"name": "H100-80GB"}, "gpus": 64},
    "reserve": {"usable_bytes": 74 * GIB},
    "candidates": [{"config": {"tp": tp, "pp": pp, "batch": 1}, "peak_bytes": (120 // (tp * pp) + 30) * GIB,
                    "step_time_s": 1.0 + tp * 0.1, "tokens_per_s": 4096 * 512 / (1.0 + tp * 0.1 + pp * 0.2),
                    "fits": (120 // (tp * pp) + 30) < 74} for tp in (1, 2, 4, 8) for pp in (1, 2, 4)],
    "pareto": [],
}
PLAN["pareto"] = [c for c in PLAN["candidates"] if c["fits"]][:3]

COMPARE = {
    "schema": "trainmem.compare/2",
    "rows": [{"name": "model.layers.0.mlp", "estimate_bytes": 3 * 2**20, "trace_bytes": 3 * 2**20, "ratio": 1.0,
              "missing_in": None},
             {"name": "model.layers.0.self_attn", "estimate_bytes": 2**20, "trace_bytes": 1_000_000,
              "ratio": 1.048576, "missing_in": None}],
    "activations": {"estimate_bytes": 4 * 2**20, "trace_bytes": 3 * 2**20 + 1_000_000, "ratio": 1.01},
    "peak": {"estimate_bytes": 9 * 2**20, "trace_bytes": 9 * 2**20 - 512, "ratio": 1.00005,
             "estimate_phase": "backward_start", "trace_phase": "backward"},
}

TRACE = {
    "schema": "trainmem.trace/2", "inputs": {"model": {"name": "tiny-trace", "source": "code"},
                                             "step": {"batch": 1, "seq": 4}}, "meta": {"fake": True},
    "peak_bytes": 5 * 2**20, "peak_logical_bytes": 5 * 2**20 - 100, "peak_phase": "backward",
    "peak_op": "mm", "peak_module": "model.layers.1.mlp", "peak_reserved_bytes": 6 * 2**20,
    "peak_reserved_expandable_bytes": 5 * 2**20, "fragmentation": 0.1, "num_allocations": 40,
    "totals_at_peak_bytes": {"parameter": 2**20, "gradient": 2**20, "activation": 3 * 2**20},
    "modules": [{"name": "model.layers.1.mlp", "forward_peak_bytes": 3 * 2**20, "backward_peak_bytes": 5 * 2**20}],
    "top_at_peak": [{"name": "model.layers.1.mlp.mm", "category": "activation", "bytes": 2**20, "op": "mm",
                     "phase": "forward", "shape": [4, 64], "dtype": "float32"}],
    "items": [{"name": "model.layers.1.mlp.mm", "category": "activation", "shape": [4, 64], "dtype": "float32",
               "bytes": 1024, "formula": "aten.mm"}],
    "timeline": {"index": list(range(40)), "allocated_bytes": [min(i, 30) * 2**17 for i in range(40)],
                 "reserved_bytes": [6 * 2**20] * 40, "phases": [[0, "forward"], [12, "backward"], [30, "optimizer"]]},
}
