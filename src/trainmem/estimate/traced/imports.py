"""Import transformers' model code without torchao, for a cold ``--profile traced`` estimate.

Building any transformers model imports ``transformers.modeling_utils``, which imports the
quantizers (``transformers/quantizers/auto.py``); ``quantizer_torchao.py`` imports
``torchao.prototype.safetensors`` at module level when ``is_torchao_available()``, and with it all
of torchao: 3.1 s of CPU on the 2-CPU machine, half of a cold traced estimate. A traced estimate
builds models from their config on the meta device and on fake tensors and never quantizes with
torchao through transformers, so that one import runs with ``is_torchao_available`` answering
False; the module's own name is set back right after, so the quantizer checks torchao as usual
when called. What is lost in this process: transformers' torchao safetensors helpers
(``flatten_tensor_state_dict``, for saving torchao-quantized checkpoints). trainmem imports
torchao itself where it uses it (Float8, low-bit optimizers), unaffected.

Nothing happens when ``transformers.modeling_utils`` is already imported, or torchao is absent.
"""

from __future__ import annotations

import sys

__all__ = ["import_transformers_models"]


def import_transformers_models() -> None:
    if "transformers.modeling_utils" in sys.modules:
        return
    import transformers.utils as tu

    real = tu.is_torchao_available
    tu.is_torchao_available = lambda *a, **k: False
    try:
        import transformers.modeling_utils  # noqa: F401
    finally:
        tu.is_torchao_available = real
        q = sys.modules.get("transformers.quantizers.quantizer_torchao")
        if q is not None:
            q.is_torchao_available = real
