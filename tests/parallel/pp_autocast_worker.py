"""One rank of a real gloo pipelining step (``measure_dist/worker.py``, strategy ``pp``) whose schedule runs under
one ``torch.autocast``, as torchtitan's train step wraps ``pp_schedule.step()`` in its ``maybe_enable_amp`` context
and trainmem's trace (trace/step.py ``one_step``) wraps ``pipe.step()``: ``PipelineScheduleSingle.step``
(torch/distributed/pipelining/schedules.py), every micro-batch's forward and backward, is entered inside
``torch.autocast("cpu", dtype)``; the model stays fp32.

Run by tests/parallel/test_pp_autocast_real.py under torchrun (gloo, CPU):
``python pp_autocast_worker.py OUT_DIR '<scenarios json>'``.
"""

from __future__ import annotations


def run(sc: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from trainmem.measure_dist import worker

    sc = dict(sc)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[sc.pop("autocast")]
    plain = schedules.PipelineScheduleSingle.step

    def step(self, *args, **kwargs):
        with torch.autocast("cpu", dtype=dtype):
            return plain(self, *args, **kwargs)

    schedules.PipelineScheduleSingle.step = step
    try:
        return worker.run(sc, dist.get_rank(), dist.get_world_size())
    finally:
        schedules.PipelineScheduleSingle.step = plain


if __name__ == "__main__":
    from torchrun_scripts import worker_main

    raise SystemExit(worker_main(run))
