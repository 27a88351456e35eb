"""Which module is running: the recorder's module stack, recompute depth and progress.

Module attribution uses torch's ``ModTracker`` hooks (forward pre/post, multi-grad hooks for backward)
with our own push order, so the innermost active module wins; its multi-grad hooks are removed once
fired, so they keep no autograd graph alive (trace/mod_tracker_hooks.py). A module's forward entered
during backward is a checkpoint's recompute.
"""

from __future__ import annotations

import torch
from torch.distributed._tools.mod_tracker import ModTracker

from trainmem.trace.mod_tracker_hooks import ReleasedMultiGradHooks

__all__ = ["ModuleStack", "in_backward"]


def in_backward() -> bool:
    """Autograd's engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


class ModuleStack:
    """``stack``: the active modules' names, innermost last; ``recompute``: how many forwards run inside
    backward now. Names are appended to ``module_order`` when first seen. ``progress(fraction, phase)``
    gets one unit per module forward and per module backward."""

    def __init__(self, model: torch.nn.Module | None, module_order: list[str], progress=None) -> None:
        self.stack: list[str] = []
        self.recompute = 0
        self._names: dict[int, str] = {}
        if model is not None:
            self._names = {id(m): n for n, m in model.named_modules()}
        self._order = module_order
        self._progress = progress
        self._mod_tracker = ModTracker()
        self._multi_grad_hooks = ReleasedMultiGradHooks()  # ModTracker's, freed as in a step without it

    def _name(self, mod) -> str:
        name = self._names.get(id(mod)) if mod is not None else None
        if name is None:
            name = self._mod_tracker.get_known_fqn(mod) if mod is not None else None
            name = name or "<unknown>"
        if name not in self._seen:
            self._seen.add(name)
            self._order.append(name)
        return name

    def _tick(self, phase: str) -> None:
        if self._progress is None:
            return
        self._units += 1
        done = min(self._units / self._total_units, 0.99)
        if done - self._shown >= 0.01:
            self._shown = done
            self._progress(done, phase)

    def _pre_fw(self, mod, _inputs) -> None:
        self.stack.append(self._name(mod))
        if in_backward():
            self.recompute += 1
        else:
            self._tick("forward")

    def _post_fw(self, mod, _inputs, _outputs) -> None:
        name = self._name(mod)
        self._pop(name)
        if in_backward() and self.recompute:
            self.recompute -= 1

    def _pre_bw(self, mod, _grads) -> None:
        self.stack.append(self._name(mod))
        self._tick("backward")

    def _post_bw(self, mod, _grads) -> None:
        self._pop(self._name(mod))

    def _pop(self, name: str) -> None:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i] == name:
                del self.stack[i]
                return

    def __enter__(self) -> "ModuleStack":
        self._seen: set[str] = set()
        self._units, self._shown = 0, 0.0
        self._total_units = 2 * max(len(self._names), 1)
        self._mod_tracker.register_user_hooks(self._pre_fw, self._post_fw, self._pre_bw, self._post_bw)
        self._multi_grad_hooks.__enter__()
        self._mod_tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mod_tracker.__exit__(*exc)
        self._mod_tracker.clear_user_hooks()
        self._multi_grad_hooks.__exit__(*exc)

    def done(self) -> None:
        if self._progress is not None:
            self._progress(1.0, "done")
