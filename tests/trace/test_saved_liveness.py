"""``trace.saved.saved_tensors`` counts what autograd still holds when forward returns.

DeepSeek-V3's router (transformers ``modeling_deepseek_v3.py``, ``DeepseekV3TopkRouter.forward``)
packs tensors on a graph branch that forward drops -- the group top-2 indices, the group top-k
indices and the ``masked_fill`` mask feed only integer indices -- so they die before forward ends,
and the storage addresses they free can be reused by tensors saved later, which must still count."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainmem.trace.saved import saved_tensors  # noqa: E402


@pytest.mark.slow  # importing transformers' DeepSeek-V3 modules costs seconds on the shared CPUs
def test_the_group_limited_router_keeps_only_what_backward_reads():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    T, H, E, k = 64, 16, 8, 2
    router = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=k,
                                                   n_group=4, topk_group=2, norm_topk_prob=True))
    torch.nn.init.normal_(router.weight)
    x = torch.randn(T, H, requires_grad=True)
    outs = []

    def forward():
        for _ in range(3):  # later rounds may land on the addresses the dropped tensors freed
            outs.append(router(x)[1])
        return sum(w.sum() for w in outs)

    saved, loss = saved_tensors(router, forward)
    # per call: sigmoid's output (T, E) fp32, gather's indices (T, k) int64, the in-place division's
    # sum (T, 1) and weights (T, k) fp32; the input x is a leaf the caller made (one storage)
    per_call = sorted([(T * E * 4, "float32"), (T * k * 8, "int64"), (T * 4, "float32"), (T * k * 4, "float32")])
    assert sorted((s.nbytes, s.dtype) for s in saved) == sorted(per_call * 3 + [(T * H * 4, "float32")])
    loss.backward()
