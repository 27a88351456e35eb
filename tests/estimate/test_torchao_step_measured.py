"""torchao's compiled AdamW8bit/AdamW4bit step, measured: the bytes its generated code holds above
the parameter, gradient and states equal ``estimate/optimizer_step.py``'s rule to the byte.

The rule was read off inductor's CPU code (``TORCH_LOGS=output_code``); here the real step runs
(torchao 0.18 ``torchao/optim/adam.py`` ``_AdamBase.step``: ``torch.compile(single_param_adam,
fullgraph=True, dynamic=False)`` per parameter, inductor's C++ backend) under ``torch.profiler`` with
``profile_memory=True``, which records every CPU allocator event, the generated code's
``empty_strided_cpu`` buffers included. The third step is measured: the first makes the states and
compiles, the second runs the compiled code once more. One bf16 parameter of 256 x 2048 values
(a multiple of both blocks, over torchao's 4096-value threshold).

Slow: each optimizer compiles a C++ kernel (40-80 s on two loaded cores).
"""

from __future__ import annotations

import pytest

from trainmem.estimate.optimizer_step import Stepped, step_temporaries
# the CPU allocator's events under torch.profiler(profile_memory=True): the highest running sum
from trainmem.measure_dist.worker import _profiled_peak
from trainmem.specs import ImplSpec, StepSpec

ROWS, COLS = 256, 2048


@pytest.mark.slow
@pytest.mark.parametrize("opt,cls", [("torchao-adamw8bit", "AdamW8bit"), ("torchao-adamw4bit", "AdamW4bit")])
def test_compiled_step_holds_what_the_rule_says(opt, cls):
    torch = pytest.importorskip("torch")
    ao = pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(ROWS, COLS, dtype=torch.bfloat16))
    optim = getattr(ao, cls)([p], lr=1e-3)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        optim.step()
    p.grad = torch.randn_like(p)
    measured = _profiled_peak(optim.step)

    n = ROWS * COLS
    want, rule = step_temporaries(StepSpec(optimizer=opt, precision="bf16"), ImplSpec(device="cpu"),
                                  Stepped(n * 2, (n * 2,), 2))
    # 8-bit: 2·n·4 + 2·(n/256)·4 = 4,194,304 + 16,384 = 4,210,688
    # 4-bit: n·(2·1 + 2·4 + 2·8) + 2·(n/128)·4 = 13,631,488 + 32,768 = 13,664,256
    assert want == {"torchao-adamw8bit": 4_210_688, "torchao-adamw4bit": 13_664_256}[opt], rule
    assert measured == want, rule
