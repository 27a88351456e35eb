"""The saved values of every region a compiled trace partitions, for the compiled TP tests."""

from trainmem.specs import ImplSpec

#: per-block compile on CPU, as torchtitan's apply_compile (tests/trace/test_trace_compile_tp.py, _2d.py)
BLOCK = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block")


def trace_with_regions(config, step, impl, parallel):
    """``(traced, regions)``: ``trace_step`` and, per partitioned region, the ``SavedValue``s
    ``trace/compiled.py``'s ``saved_values`` read off its backward graph, in partition order."""
    from trainmem.trace import compiled, trace_step

    seen: list = []
    read = compiled.saved_values

    def record(backward_graph):
        seen.append(read(backward_graph))
        return seen[-1]

    compiled.saved_values = record
    try:
        traced = trace_step(config, step, impl, parallel=parallel)
    finally:
        compiled.saved_values = read
    return traced, seen
