"""One rank of real DTensor TP steps (the worker's torchtitan plan, measure_dist/worker.py
``_apply_tp``) under the op-boundary tracker (``measure_dist.tracking.LiveTracker``) and
torch.profiler's CPU memory events at once, recording what both read where a functional
collective's ``AsyncCollectiveTensor`` appears.

Run by tests/parallel/test_op_boundary_tp.py under torchrun (gloo, CPU):
``python op_boundary_worker.py OUT_DIR '<scenarios json>'``. Per step (two, after two warm-up
steps), for every op whose outputs include an ``AsyncCollectiveTensor`` (the
``_c10d_functional._wrap_tensor_autograd`` op and views of its result): the tracker's live bytes
before and after the op, and the wrapped bytes; for every ``_wrap_tensor_autograd`` op, the
allocator's bytes allocated inside it (profiler ``[memory]`` events within its time range) and the
running sum of the step's ``[memory]`` events at its end beside the tracker's live bytes above the
step's start; and both peaks of the step.
"""

from __future__ import annotations

_WRAP = "_c10d_functional::_wrap_tensor_autograd"


def run(sc: dict) -> dict:
    import time

    import torch.distributed as dist
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.profiler import ProfilerActivity, profile

    from torchrun_scripts import tp_warm_model
    from trainmem.measure_dist.tracking import LiveTracker, parameter_storage_keys

    class Recording(LiveTracker):
        """The tracker, noting its live bytes around each op that outputs a collective's wrapper."""

        def __init__(self) -> None:
            super().__init__()
            self.points: list[dict] = []

        def _after_op(self, func, tensors: list) -> None:
            before = self.storages.live_bytes
            super()._after_op(func, tensors)
            wrappers = [t for t in tensors if isinstance(t, AsyncCollectiveTensor)]
            if wrappers:
                self.points.append({"op": str(func), "before": before, "after": self.storages.live_bytes,
                                    "wrapped_bytes": sum(w.elem.untyped_storage().nbytes() for w in wrappers),
                                    "t_ns": time.time_ns()})

    model, ids, step = tp_warm_model(sc)
    steps = []
    for _ in range(2):
        tracker = Recording()
        tracker.watch(model.parameters())
        tracker.watch(model.buffers())
        tracker.watch([ids])  # alive before the step: not the allocator's during it
        tracker.saved_exclude = parameter_storage_keys(model)
        start = tracker.current_bytes()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with tracker:
                step()
        events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
        memory = [(e.start_ns(), e.nbytes(), e.start_thread_id()) for e in events if e.name() == "[memory]"]
        # the profiler also records the wrapping ops run inside a DTensor op, which the tracker's
        # dispatch mode does not see: each tracked one is the last to end before the tracker read
        # the live set (kineto's clock is the epoch in ns, as time.time_ns: measured ~10 µs apart)
        wraps = [(e.start_ns(), e.start_ns() + e.duration_ns(), e.start_thread_id())
                 for e in events if e.name() == _WRAP]
        points = tracker.points
        for p in points:
            read_ns = p.pop("t_ns")
            if p["op"] != "_c10d_functional._wrap_tensor_autograd.default":
                continue
            t0, t1, thread = max((w for w in wraps if w[1] <= read_ns), key=lambda w: w[1])
            # on the op's own thread: one run recorded 16,384 B within a wrapping op's time range (bf16 SP),
            # while the op makes only the wrapper: most likely gloo's thread meanwhile (not recorded which)
            p.update(allocated_inside=sum(n for t, n, th in memory if t0 <= t <= t1 and n > 0 and th == thread),
                     allocator_running=sum(n for t, n, _ in memory if t <= t1), tracker_running=p["after"] - start)
        cur = peak = 0
        for _, n, _ in memory:
            cur += n
            peak = max(peak, cur)
        steps.append({"points": points, "wrap_ops_profiled": len(wraps), "tracker_peak_above_start":
                      tracker.peak_bytes - start, "allocator_peak_above_start": peak})
        dist.barrier()
    return {"scenario": sc, "steps": steps}


if __name__ == "__main__":
    from torchrun_scripts import worker_main

    raise SystemExit(worker_main(run))
