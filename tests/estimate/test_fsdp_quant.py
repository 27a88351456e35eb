"""FSDP2 all-gathers a torchao NF4 weight as its own storages (``estimate/fsdp_quant.py``): against
torchao's ``NF4Tensor.fsdp_pre_all_gather`` on CPU, and in a QLoRA estimate under FSDP."""

from __future__ import annotations

import math

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.fsdp_quant import quantized_gather_bytes
from trainmem.estimate.quant4bit import QUANT_LAYOUTS
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import spec_from_hf_config

QLORA = FinetuneSpec(mode="qlora", lora_rank=8, lora_alpha=16, lora_targets=("q_proj", "v_proj"),
                     adapter_dtype="param", quant_impl="torchao-nf4")
SHAPE = (512, 256)  # 131072 weights: 2048 blocks of 64, 8 scaler blocks of 256


def _gathered(shape=SHAPE) -> int:
    items = QUANT_LAYOUTS["torchao-nf4"]("w", shape, QLORA, "bfloat16")
    nf4 = {i.name for i in items if i.dtype == "nf4"}
    return int(sum(quantized_gather_bytes(i, nf4) * math.prod(i.shape) for i in items))


def test_gathered_bytes_exact():
    # codes numel/2 = 65536, int8 scalers numel/64 = 2048, bf16 factors numel/64/256 x 2 = 16; the scaler
    # mean and NF4 table are metadata. bf16 would be numel x 2 = 262144
    assert _gathered() == 65536 + 2048 + 16
    assert quantized_gather_bytes(QUANT_LAYOUTS["torchao-nf4"]("w", SHAPE, QLORA, "bfloat16")[0], set()) == 0.5


@pytest.mark.slow
def test_torchaos_pre_all_gather_inputs():  # ~30 s: torchao's import
    torch = pytest.importorskip("torch")
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    weight = nf4.to_nf4(torch.randn(*SHAPE, dtype=torch.bfloat16))
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        inputs, _meta = weight.fsdp_pre_all_gather(init_device_mesh("cpu", (1,)))
    finally:
        if own:
            dist.destroy_process_group()
    assert sum(t.numel() * t.element_size() for t in inputs) == _gathered()


def test_qlora_fsdp_allgather_is_nf4_sized():
    # tiny Llama under FSDP over 2 ranks: one block's gathered weights are its NF4 storages (codes,
    # scalers, factors) and its bf16 norms and adapters, not numel x 2 for the quantized weights
    cfg = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256)
    est = estimate(spec_from_hf_config(cfg), StepSpec(batch=1, seq=64, precision="bf16"),
                   ImplSpec(recompute="full"), ParallelSpec(dp=2, fsdp="full"), finetune=QLORA)
    fwd = next(p for p in est.phases if p.name == "forward")
    # per block: q, k, v, o (256 x 256) and gate, up, down (512 x 256) quantized; q and v carry rank-8
    # adapters (2 x 8 x 256 x 2 each); two RMSNorm weights 2 x 256 x 2
    quant = 4 * _gathered((256, 256)) + 3 * _gathered((512, 256))
    assert fwd.parts["fsdp_allgather"] == quant + 2 * 2 * 8 * 256 * 2 + 2 * 256 * 2
