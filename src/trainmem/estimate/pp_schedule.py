"""What a pipeline rank holds over time: its schedule's actions, in the order
torch.distributed.pipelining runs them (torch 2.13), and the activations and FSDP2 unsharded
gradients alive at each.

* GPipe (``ScheduleGPipe._step_microbatches``): every forward, then every backward.
* 1F1B (``Schedule1F1B._step_microbatches``): ``min(m, pp - rank)`` warm-up forwards, then one
  backward and one forward at a time, then the remaining backwards.
* Interleaved 1F1B (``ScheduleInterleaved1F1B._calculate_single_rank_operations`` with
  ``_get_warmup_ops`` and ``_get_1f1b_rank_ops``): rank ``r`` runs stages ``r + j·pp``;
  ``W = (v - 1)·mpr + 2·(pp - 1 - r)`` warm-up forwards (capped at ``v·m``; ``mpr = m // rounds``,
  ``rounds = max(1, m // pp)``), forward stage of op ``k`` is chunk ``(k // mpr) mod v``, backward
  stage of op ``k`` chunk ``v - 1 - ((k - W) // mpr) mod v``; steady state is forward then backward.
  ``_add_reduce_grad`` puts each stage's ``REDUCE_GRAD`` right after its last backward, so under
  FSDP2 a virtual stage's unsharded gradients live from its first backward to its own last one,
  not to the end of the step.

Pure functions of the schedule's sizes; the caller gives each local virtual stage's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action", "rank_actions", "virtual_split", "Timeline", "timeline", "local_stages", "stage_outputs_held",
           "stage_io_held"]

Action = tuple[str, int, int]  # ("F" | "B" | "R", local virtual stage, micro-batch; -1 for "R")


def _interleaved(pp: int, v: int, m: int, rank: int) -> list[Action]:
    rounds = max(1, m // pp)
    mpr = m // rounds
    warmup = min((v - 1) * mpr + 2 * (pp - 1 - rank), m * v)
    fwd_bwd = m * v - warmup
    fwd_mb, bwd_mb = [0] * v, [0] * v
    out: list[Action] = []
    for op in range(m * v + warmup):  # warm-up forwards, 1F1B pairs, cool-down backwards
        if op < warmup + fwd_bwd:
            j = (op // mpr) % v
            out.append(("F", j, fwd_mb[j]))
            fwd_mb[j] += 1
        if op >= warmup:
            j = v - 1 - ((op - warmup) // mpr) % v
            out.append(("B", j, bwd_mb[j]))
            bwd_mb[j] += 1
            if bwd_mb[j] == m:
                out.append(("R", j, -1))
    return out


def rank_actions(schedule: str, *, pp: int, v: int, m: int, rank: int) -> list[Action]:
    """The compute actions of pipeline rank ``rank`` in run order (``R``: the stage's gradient
    reduction); local virtual stage ``j`` is global stage ``rank + j·pp``."""
    if schedule == "interleaved":
        return _interleaved(pp, v, m, rank)
    if schedule == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)] + [("R", 0, -1)]
    warmup = min(m, pp - rank)  # 1F1B (zero-bubble ZB-H1 keeps its memory)
    out: list[Action] = [("F", 0, i) for i in range(warmup)]
    for i in range(m):
        out.append(("B", 0, i))
        if warmup + i < m:
            out.append(("F", 0, warmup + i))
    return out + [("R", 0, -1)]


def virtual_split(layers: int, v: int, rank: int, pp: int) -> list[int]:
    """A rank's layers over its ``v`` virtual stages: an even split whose extra layers go to the
    virtual stages that are neither the model's first nor its last stage first (torchtitan's
    ``generate_split_points``: 126 layers over 16 stages as 7, 8 x 14, 7, so rank 0 runs 7 + 8)."""
    base, extra = divmod(layers, v)
    total = pp * v
    order = sorted(range(v), key=lambda j: (rank + j * pp) in (0, total - 1))
    sizes = [base] * v
    for j in order[:extra]:
        sizes[j] += 1
    return sizes


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """The worst moments of one rank's step, each with the bytes alive then."""

    max_held: float
    """Most activation bytes held at once (after a forward, before the next backward frees)."""
    forward_grads: float
    """Unsharded gradients alive at the forward where held activations + gradients peak."""
    backward_held: float
    """Activations held when the backward with the most held activations + gradients starts."""
    backward_grads: float
    """Unsharded gradients alive at the end of that backward (its stage's included)."""
    end_grads: float
    """Unsharded gradients alive at the rank's last backward, before its reduction."""


def timeline(actions: list[Action], held: list[float], grads: list[float]) -> Timeline:
    """Walk ``actions`` with ``held[j]``: one micro-batch's activations of local virtual stage
    ``j``, ``grads[j]``: its unsharded gradient bytes (alive from its first backward to its
    ``R``)."""
    cur = 0.0
    live: set[int] = set()
    top = 0.0
    fwd = (-1.0, 0.0)
    bwd = (-1.0, 0.0, 0.0)
    end = 0.0
    for kind, j, _ in actions:
        g = sum(grads[k] for k in live)
        if kind == "F":
            cur += held[j]
            top = max(top, cur)
            if cur + g > fwd[0]:
                fwd = (cur + g, g)
        elif kind == "B":
            live.add(j)
            g = sum(grads[k] for k in live)
            if cur + g > bwd[0]:
                bwd = (cur + g, cur, g)
            end = g
            cur -= held[j]
        else:
            live.discard(j)
    return Timeline(max_held=top, forward_grads=fwd[1], backward_held=bwd[1], backward_grads=bwd[2],
                    end_grads=end)


def local_stages(schedule: str, *, pp: int, v: int, rank: int) -> list[int]:
    """The global stage ids rank ``rank`` runs (torchtitan's ``stage_ids_this_rank``, style "loop")."""
    return [rank + j * pp for j in range(v if schedule == "interleaved" else 1)]


def _send_holds(schedule: str, actions: list[Action], m: int, rank: int, pp: int) -> dict[tuple[int, int], int]:
    """Index of the action after which the schedule drops the last reference its sends keep to
    micro-batch ``mb``'s stage output of local stage ``j`` (``len(actions)``: when ``step`` returns).
    torch/distributed/pipelining/schedules.py (torch 2.13), a real send Work holding its tensor (gloo):
    ``ScheduleGPipe._step_microbatches`` keeps every forward send's Work in ``fwd_sends_to_wait`` until it
    returns; ``_PipelineScheduleRuntime._step_microbatches`` (interleaved) every send in ``send_ops``
    until its last action (as do its zero-bubble schedules, ``ScheduleInterleavedZeroBubble`` and
    ``ScheduleZBVZeroBubble``, also runtimes); ``Schedule1F1B._step_microbatches`` keeps the last warm-up send it fired,
    micro-batch ``w - 2`` (``w = min(m, pp - rank)``), in ``send_work`` until the 1B1F loop ends (after
    backward ``m - w``), and each forward's send ops (``P2POp`` holds the tensor) in ``fwd_sends`` until
    the next forward, the last one's until it returns."""
    end = len(actions)
    if schedule != "1f1b":
        return {(j, mb): end for kind, j, mb in actions if kind == "F"}
    fwd = [i for i, (kind, _, _) in enumerate(actions) if kind == "F"]
    out = {(0, k): (fwd[k + 1] if k + 1 < m else end) for k in range(m)}
    w = min(m, pp - rank)
    if w >= 2:
        out[0, w - 2] = max(out[0, w - 2], actions.index(("B", 0, m - w)))
    return out


def stage_outputs_held(schedule: str, *, pp: int, v: int, m: int, rank: int) -> tuple[int, int]:
    """Most stage outputs the rank holds at once, and how many it still holds after its last backward.
    ``_PipelineStageBase.forward_one_chunk`` (torch/distributed/pipelining/stage.py) keeps each
    micro-batch's output in ``fwd_cache`` until its backward pops it; the schedule's sends keep some
    longer (:func:`_send_holds`). The model's last stage is left out: it sends nothing and its output,
    the logits, is counted apart as ``output_chunks``."""
    v = v if schedule == "interleaved" else 1
    ids = local_stages(schedule, pp=pp, v=v, rank=rank)
    acts = rank_actions(schedule, pp=pp, v=v, m=m, rank=rank)
    holds = _send_holds(schedule, acts, m, rank, pp)
    sends = {j for j, g in enumerate(ids) if g != pp * v - 1}
    alive: set[tuple[int, int]] = set()
    done: set[tuple[int, int]] = set()
    top = 0
    for i, (kind, j, mb) in enumerate(acts):
        if j not in sends:
            continue
        if kind == "F":
            alive.add((j, mb))
            top = max(top, len(alive))
        elif kind == "B":
            done.add((j, mb))
        alive = {o for o in alive if o not in done or holds[o] > i}
    return top, len(alive)


def stage_io_held(schedule: str, *, pp: int, v: int, m: int, rank: int, held: list[float],
                  one: float) -> dict[str, tuple[int, int]]:
    """(stage outputs, input gradients) the rank holds at its worst forward (after it), at its worst
    backward (as it starts) and after its last backward ("end"), the worst being where ``held``
    activations (``held[j]``: one micro-batch of local stage ``j``) plus these ``one``-sized tensors
    peak. Outputs as :func:`stage_outputs_held`. Each backward of a stage but the model's first sends
    its input gradient (``get_bwd_send_ops``): ``ScheduleGPipe`` keeps every send in
    ``bwd_sends_to_wait`` and the runtime schedules (interleaved, zero-bubble) in ``send_ops`` until
    ``step`` returns; ``Schedule1F1B`` keeps the last one in ``bwd_sends`` (1B1F loop, a ``P2POp``)
    or ``send_work`` (cool-down) until the next backward is done, the last one until it returns
    (torch/distributed/pipelining/schedules.py, torch 2.13)."""
    v = v if schedule == "interleaved" else 1
    ids = local_stages(schedule, pp=pp, v=v, rank=rank)
    acts = rank_actions(schedule, pp=pp, v=v, m=m, rank=rank)
    holds = _send_holds(schedule, acts, m, rank, pp)
    out_stages = {j for j, g in enumerate(ids) if g != pp * v - 1}
    grad_stages = {j for j, g in enumerate(ids) if g > 0}
    alive: set[tuple[int, int]] = set()
    done: set[tuple[int, int]] = set()
    cur, sent = 0.0, 0
    fwd, bwd = (-1.0, 0, 0), (-1.0, 0, 0)
    for i, (kind, j, mb) in enumerate(acts):
        if kind == "F":
            cur += held[j]
            alive |= {(j, mb)} if j in out_stages else set()
            fwd = max(fwd, (cur + (len(alive) + sent) * one, len(alive), sent))
        elif kind == "B":
            bwd = max(bwd, (cur + (len(alive) + sent) * one, len(alive), sent))
            cur -= held[j]
            done.add((j, mb))
            if j in grad_stages:
                sent = 1 if schedule == "1f1b" else sent + 1
        alive = {o for o in alive if o not in done or holds[o] > i}
    return {"forward": fwd[1:], "backward": bwd[1:], "end": (len(alive), sent)}
