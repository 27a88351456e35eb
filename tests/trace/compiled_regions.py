"""The saved values of every region a compiled trace partitions, for the compiled TP tests."""

import re

from trainmem.specs import ImplSpec

#: per-block compile on CPU, as torchtitan's apply_compile (tests/trace/test_trace_compile_tp.py, _2d.py)
BLOCK = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block")


def without_symints(values):
    """The saved tensors only. In the clean-clone slow set (one process, after many other compiled traces) a
    TP block's region also saved a SymInt (``primals_4``, value 0) that the same trace run alone does not; it
    holds no memory, and where it comes from (some process-wide state dynamo reads) is not found yet, so
    the region comparisons leave SymInts out."""
    return [v for v in values if (v.dtype if hasattr(v, "dtype") else v[2]) != "symint"]


def comparable(values) -> list[tuple]:
    """``(name, shape, dtype, nbytes)`` per saved tensor, SymInts left out (:func:`without_symints`) and graph
    inputs named ``primals`` without their number: a SymInt input takes a number too, which shifts the
    later inputs' numbers on whichever side saved one (seen both ways in the slow set)."""
    out = []
    for v in without_symints(values):
        name, shape, dtype, nbytes = (v.name, v.shape, v.dtype, v.nbytes) if hasattr(v, "dtype") else v
        out.append((re.sub(r"^primals_\d+$", "primals", name), list(shape), str(dtype).removeprefix("torch."), nbytes))
    return out


def trace_with_regions(config, step, impl, parallel):
    """``(traced, regions)``: ``trace_step`` and, per partitioned region, the ``SavedValue``s
    ``trace/compiled.py``'s ``saved_values`` read off its backward graph, in partition order."""
    from trainmem.trace import compiled, trace_step

    seen: list = []
    read = compiled.saved_values

    def record(backward_graph):
        values = read(backward_graph)
        seen.append(without_symints(values))
        return values

    compiled.saved_values = record
    try:
        traced = trace_step(config, step, impl, parallel=parallel)
    finally:
        compiled.saved_values = read
    return traced, seen
