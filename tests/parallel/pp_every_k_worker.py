"""One rank of a real gloo pipelining step (``measure_dist/worker.py``, strategy ``pp``) with torchtitan's
layer-level every-k checkpointing applied as torchtitan applies it, not as trainmem models it.

torchtitan's ``_apply_layer_sac`` (distributed/activation_checkpoint.py) increments a module-level counter for each
block ``apply_ac`` visits and wraps the block in ``ptd_checkpoint_wrapper`` (torch's ``checkpoint_wrapper``,
non-reentrant) when ``count % k == 0``; ``apply_ac`` runs on each stage model a rank builds, after the cut. Here the
worker's stage cut (``_pipeline_stage_module``) is followed by the same loop over the stage's blocks with a
counter kept per process, and the result records which of the model's blocks were wrapped. With ``every_from="first"``
transformers' own count runs instead: ``activation_checkpointing_enable(every_n_layers=k)`` on the whole model before
the cut (as a Trainer calls it), the stages keeping their blocks' ``gradient_checkpointing`` flags.

Run by tests/parallel/test_pp_every_k_real.py under torchrun (gloo, CPU):
``python pp_every_k_worker.py OUT_DIR '<scenarios json>'``.
"""

from __future__ import annotations

_count = 0  # torchtitan's _layer_sac_count: one per process


def run(sc: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from trainmem.measure_dist import worker

    global _count
    _count = 0  # one scenario is one job
    sc = dict(sc)
    k, start = sc.pop("every"), sc.pop("every_from", "kth")
    wrapped: list[int] = []
    cut = worker._pipeline_stage_module

    def stage_with_ac(model, stage, num_stages, sp_mesh=None):
        global _count
        per = len(model.model.layers) // num_stages
        if start == "first":  # transformers' every_n_layers on the whole model, then the cut keeps the flags
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                                  every_n_layers=k)
            mod = cut(model, stage, num_stages, sp_mesh)
            wrapped.extend(stage * per + i for i, block in enumerate(mod.layers) if block.gradient_checkpointing)
            return mod
        mod = cut(model, stage, num_stages, sp_mesh)
        for i, block in enumerate(mod.layers):
            _count += 1
            if _count % k == 0:
                mod.layers[i] = checkpoint_wrapper(block)
                wrapped.append(stage * per + i)
        return mod

    worker._pipeline_stage_module = stage_with_ac
    try:
        out = worker.run(sc, dist.get_rank(), dist.get_world_size())
    finally:
        worker._pipeline_stage_module = cut
    return {**out, "wrapped_blocks": wrapped}


if __name__ == "__main__":
    from torchrun_scripts import worker_main

    raise SystemExit(worker_main(run))
