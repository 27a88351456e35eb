"""The QLoRA dequantization temporary under ``--quant-impl torchao-nf4`` is the working set of torchao's
own ``NF4Tensor.get_original_weight`` (estimate/finetune.py ``torchao_nf4_dequant_bytes``): measured
here on real CPU tensors, every storage the call makes, to the byte. It was one weight in the compute
dtype (numel·b), 7x under it in bf16: the trace of a tiny Llama QLoRA step (trace/qlora.py) peaks
inside that call."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")

from trainmem.estimate.finetune import torchao_nf4_dequant_bytes  # noqa: E402
from trainmem.trace.live import LiveStorages  # noqa: E402

pytestmark = pytest.mark.slow  # importing torchao takes ~6 s on these machines


@pytest.mark.parametrize("shape,dtype", [((256, 128), torch.bfloat16), ((512, 256), torch.bfloat16),
                                         ((256, 128), torch.float32)])
def test_dequant_working_set_equals_torchaos_call(shape, dtype):
    torch.manual_seed(0)
    w = torch.randn(*shape, dtype=dtype)
    nf4 = nf4_tensor.to_nf4(w)  # blocks of 64, scalers quantized in blocks of 256 (torchtune's)
    inner = [getattr(nf4, n) for n in nf4.__tensor_flatten__()[0]]  # the codes and constants, alive before
    with LiveStorages(inner) as live:
        before = live.now
        out = nf4.get_original_weight()
    assert out.shape == w.shape and out.dtype == dtype
    assert live.peak - before == torchao_nf4_dequant_bytes(w.numel(), w.element_size(), 64)
