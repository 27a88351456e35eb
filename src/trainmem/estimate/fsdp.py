"""FSDP2 under pipeline parallelism: unsharded gradients (and parameters) kept across micro-batches.

torch.distributed.pipelining drives FSDP2 by hand (torch 2.13):

* ``_PipelineStageBase.backward_maybe_with_nosync`` (torch/distributed/pipelining/stage.py)
  calls ``set_is_last_backward(False)``, ``set_reshard_after_backward(False)`` and
  ``set_requires_gradient_sync(False)`` on the stage's ``FSDPModule`` before *every* micro-batch's
  backward, so ``FSDPParamGroup.post_backward`` (torch/distributed/fsdp/_fully_shard/
  _fsdp_param_group.py) neither reduce-scatters nor reshards: each parameter's gradient stays
  unsharded (``unsharded_param.grad``, accumulated by autograd micro-batch after micro-batch)
  and every block, once gathered for its backward, stays gathered;
* ``_PipelineStageBase.perform_reduce_grad``, called by the schedule's ``step`` after the last
  micro-batch (``ScheduleGPipe._step_microbatches``, ``Schedule1F1B._step_microbatches`` in
  schedules.py), turns both back on and runs every group's ``post_backward``: reshard, then one
  reduce-scatter per group into the sharded gradients.

So the sharded gradients exist only from the end of backward, and before it a stage holds its
whole unsharded gradient: ``U = Σ numel(p)/tp × grad bytes`` over the stage's trainable
parameters. With ``reshard_after_forward`` the blocks are gathered again for the first backward
and then kept: after the first micro-batch's backward all of them are unsharded.

Which micro-batch each phase describes: GPipe runs every forward first, so its first backward
holds every micro-batch's activations but only the gradients made so far (the head's and the
last block's); a 1F1B stage's later forwards and backwards hold as many activations as its first
and the whole ``U``.
"""

from __future__ import annotations

__all__ = ["pp_unsharded_working"]


def pp_unsharded_working(*, block_grads: dict[int, float], root_grads: float, first_grads: float,
                         block_params: dict[int, float], gpipe: bool,
                         reshard_after_forward: bool, timeline=None) -> dict[str, dict[str, float]]:
    """Per phase, the unsharded bytes a pipeline stage under FSDP2 holds beyond its shards.

    ``block_grads``/``block_params``: each block's unsharded gradient / gathered parameter bytes;
    ``root_grads``: the gradients of parameters outside blocks (the stage's root group);
    ``first_grads``: those of them produced after the blocks' backward (the token embedding);
    ``gpipe``: all forwards before any backward; ``timeline``: the rank's
    :class:`~trainmem.estimate.pp_schedule.Timeline` under interleaved 1F1B, whose virtual stages
    each reduce right after their own last backward (estimate/pp_schedule.py).
    """
    every_grad = sum(block_grads.values()) + root_grads
    last_block = max(block_grads) if block_grads else None
    head = root_grads - first_grads
    if gpipe:  # the first micro-batch's backward: the head's, then each block's gradients appear
        grads = {"forward": 0.0, "backward_start": 0.0,
                 "backward": head + (block_grads[last_block] if last_block is not None else 0),
                 "backward_first_block": every_grad - first_grads}
    elif timeline is not None:  # the gradients alive at the rank's worst forward / backward
        grads = {"forward": timeline.forward_grads,
                 **{p: timeline.backward_grads for p in ("backward_start", "backward", "backward_first_block")}}
    else:  # 1F1B steady state: every gradient exists from the first backward on
        grads = {p: every_grad for p in ("forward", "backward_start", "backward", "backward_first_block")}
    # the end of backward: every unsharded gradient, then perform_reduce_grad's reduce-scatters
    # (the reduce-scatter buffer itself is counted with the other FSDP buffers)
    grads["backward_end"] = every_grad if timeline is None else timeline.end_grads
    out = {p: {"fsdp_pp_unsharded_grads": v} for p, v in grads.items()}
    if reshard_after_forward:  # without it every block stays gathered all step already
        # set_reshard_after_backward(False): a block gathered for its backward stays gathered;
        # by the first block's backward (and at the end of backward) every block is
        all_blocks = sum(block_params.values())
        out["backward_first_block"]["fsdp_pp_unsharded_params"] = all_blocks
        out["backward_end"]["fsdp_pp_unsharded_params"] = all_blocks
    return out

