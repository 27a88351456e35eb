"""--loss litgpt-chunked-ce: a measured step's kept tensors join the estimate's per key (issue 16).

``estimate/losses.py`` ``_litgpt_items`` names LitGPT's ``chunked_cross_entropy`` per chunk as the
real step makes them: from B=2 the target chunks' copies, then per chunk the log-softmax and
nll_loss's 0-dim total weight in the logits' dtype, the token count, the loss; the head runs per
128-position split (from B=2 one input copy per chunk in ``lm_head``). The one difference left: the
loop's logits (``HeldLogits``), alive at the end of the forward, which the estimate counts as the
phases' ``logits_held`` part rather than as items.
"""

from __future__ import annotations

import pytest

from measure_tiny import LLAMA

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # a real step at S=300 per case (a few seconds on 2 shared cores)

S, V = 300, LLAMA["vocab_size"]  # split(300, 128): 128, 128, 44 positions


@pytest.mark.parametrize("B", [1, 2])
def test_litgpt_chunked_loss_joins_per_tensor(B):
    from trainmem.estimate import estimate
    from trainmem.join import join_sides
    from trainmem.measure.profiling import profile_model
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.loaders import spec_from_hf_config

    step, impl = StepSpec(batch=B, seq=S, precision="bf16", loss="litgpt-chunked-ce"), ImplSpec(device="cpu")
    measured = profile_model(LLAMA, step, impl, device="cpu", steps=1, warmup=1, modules=False)
    rows = join_sides({"estimate": estimate(spec_from_hf_config(LLAMA, name="tiny"), step, impl).inventory,
                       "measured": measured.items})
    diff = {r.key: tuple(i and (i.dtype, i.bytes) for i in r.items.values()) for r in rows if not r.equal}
    # the held logits: 128·B rows, twice, then 44·B, of V bf16 logits each (lm_head's mm outputs)
    big, last = 128 * B * V * 2, 44 * B * V * 2
    assert diff == {f"lm_head:{big}B:0": (None, ("bfloat16", big)), f"lm_head:{big}B:1": (None, ("bfloat16", big)),
                    f"lm_head:{last}B:0": (None, ("bfloat16", last))}
    keys = {r.key for r in rows if r.equal}
    # per chunk (rows 128·B, 128·B, 43·B: the last drops its final position): log-softmax and a bf16 total weight
    assert {f"(root):{128 * B * V * 2}B:0", f"(root):{128 * B * V * 2}B:1", f"(root):{43 * B * V * 2}B:0"} <= keys
    assert {"(root):2B:0", "(root):2B:1", "(root):2B:2", "(root):2B:3"} <= keys  # 3 total weights, the loss
    if B == 2:  # the target chunks' copies and the head's input copies
        assert {"(root):2048B:0", "(root):2048B:1", "(root):688B:0"} <= keys
        assert {"lm_head:32768B:0", "lm_head:32768B:1", "lm_head:11264B:0"} <= keys
