"""One rank of real DTensor TP steps (the worker's torchtitan plan, measure_dist/worker.py
``_apply_tp``), recording what the functional collectives allocate and on which thread their
buffers are freed, beside torch.profiler's CPU memory events of the same step.

Run by tests/parallel/test_tp_collective_buffers.py under torchrun (gloo, CPU):
``python tp_collective_buffers_worker.py OUT_DIR '<scenarios json>'``. Per step (three, after two
warm-up steps): every ``_c10d_functional`` collective's input and output storage, every
``AsyncCollectiveTensor`` wrapper (``_wrap_tensor_autograd``), the bytes of collective outputs
and inputs whose storage was freed on a thread other than the main one (weak references on the storages:
the callback runs on the thread that drops the last reference), the net of the profiler's
``[memory]`` events over the step, and the live bytes of every storage seen after the step, read once every
collective's input and output storage is freed: gloo's worker thread drops its reference to a finished work
(``ProcessGroupGloo::runLoop``, after ``AsyncWork::execute``) some time after the main thread has moved on, so a
read right after the step saw one B·S·H buffer more or less (218,112 vs 250,880 B, fp32) under CPU load.
"""

from __future__ import annotations

_COLLECTIVES = ("_c10d_functional.all_reduce.default", "_c10d_functional.reduce_scatter_tensor.default",
                "_c10d_functional.all_gather_into_tensor.default")


def run(sc: dict) -> dict:
    import threading
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode

    from torchrun_scripts import tp_warm_model
    from trainmem.trace.storages import StorageTracker

    model, ids, _ = tp_warm_model(sc)
    main = threading.get_ident()
    steps = []
    for _ in range(3):
        rec = {"collectives": [], "wrappers": [], "off_main_freed_bytes": 0, "off_main_freed_collective_bytes": 0}
        outputs: set[int] = set()
        pending: set = set()  # the collectives' input and output entries not yet freed (by identity: keys get reused)
        phase = ["forward"]

        def on_free(entry, rec=rec, outputs=outputs, pending=pending):
            pending.discard(entry)
            if threading.get_ident() != main:
                rec["off_main_freed_bytes"] += entry.nbytes
                if entry.key in outputs:
                    rec["off_main_freed_collective_bytes"] += entry.nbytes

        storages = StorageTracker(on_free=on_free)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None, rec=rec, outputs=outputs):
                out = func(*args, **(kwargs or {}))
                tensors = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
                name = str(func)
                if name in _COLLECTIVES or name == "_c10d_functional._wrap_tensor_autograd.default":
                    i, o = args[0].untyped_storage(), tensors[0].untyped_storage()
                    item = {"op": name.split(".")[1], "phase": phase[0], "in_bytes": i.nbytes(),
                            "out_bytes": o.nbytes(), "same_storage": i._cdata == o._cdata}
                    if name in _COLLECTIVES:  # gloo's work holds the input and the output
                        outputs.update((i._cdata, o._cdata))
                        rec["collectives"].append(item)
                    else:
                        rec["wrappers"].append(item)
                for t in tensors:
                    storages.add(t)
                if name in _COLLECTIVES:
                    pending.update(e for e in (storages.get(args[0]), storages.get(tensors[0])) if e is not None)
                return out

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with Mode():
                with loss_parallel():
                    loss = model(ids, labels=ids).loss
                    phase[0] = "backward"
                    loss.backward()
                model.zero_grad(set_to_none=True)
                del loss
        rec["profiled_net_bytes"] = sum(e.nbytes() for e in prof.profiler.kineto_results.events()
                                        if e.name() == "[memory]")
        deadline = time.monotonic() + 60  # every collective buffer is dead after the step: wait for gloo's threads
        while pending and time.monotonic() < deadline:
            time.sleep(0.005)
        rec["collective_alive_after"] = len(pending)
        rec["tracked_live_after_bytes"] = storages.live_bytes
        storages.close()
        steps.append(rec)
        dist.barrier()
    return {"scenario": sc, "steps": steps}


if __name__ == "__main__":
    from torchrun_scripts import worker_main

    raise SystemExit(worker_main(run))
