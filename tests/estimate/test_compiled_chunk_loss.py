"""torchtune's chunked CE with its chunk function compiled (``estimate/compiled_chunk_loss.py``):
the rule as exact integers, and (slow) against torchtune's chunked loss with ``compute_cross_entropy``
compiled by real inductor on CPU: what autograd is handed, and the buffers inductor's generated code
allocates. The loss is the tracer's copy of torchtune's (``trace/losses.py``), itself checked against
torchtune's own class in ``tests/trace/test_trace_framework_losses.py``."""

from __future__ import annotations

import re

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.activations import activation_items
from trainmem.estimate.compiled_chunk_loss import compiled_chunk_phases
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256)
TORCHTUNE = ImplSpec(device="cpu", compile=True, compile_scope="block-loss")
B, S, V = 2, 64, 1000


def _loss_items(batch=B, seq=S):
    step = StepSpec(batch=batch, seq=seq, precision="bf16", loss="torchtune-chunked-ce")
    return {i.name: i.bytes for i in activation_items(spec_from_hf_config(LLAMA), step, TORCHTUNE)
            if i.name.startswith("loss.")}


def test_saved_set_exact():
    # the chunks' bf16 logits B*S*V*2, row max and log-sum-exp B*S*4 each, the label chunks B*S*8, the
    # token count (int64): no fp32 log-softmax (eager: B*S*V*4 = 512000), no per-chunk total weight; and
    # the fp32 loss the caller holds (estimate/loss_value.py)
    assert _loss_items() == {"loss.logits": 256000, "loss.row_max": 512, "loss.logsumexp": 512,
                             "loss.target": 1024, "loss.token_count": 8, "loss.value": 4}


def test_phases_exact():
    # 8 chunks of B*8 = 16 rows. Forward: the shifted (B, S) labels (B=2) and two fp32 scalars. Loss
    # backward, newest chunk first: the last chunk (j=7) writes its bf16 gradient 16*1000*2 and a (16, 1)
    # fp32 buffer, nothing freed yet, beside the loss's seed and the gradient still to reach the other
    # chunks (2 x 4; the loss itself is the activation item loss.value); earlier chunks have freed 16 B per
    # row of each later chunk (stats, label copies)
    ph = compiled_chunk_phases("torchtune-chunked-ce", B=B, S=S, V=V, logits_dtype="bfloat16")
    assert ph.forward == {"labels": 1024, "loss_scalars": 8}
    assert ph.backward_start == {"logits_grad": 32000 + 64 + 8}
    assert ph.held == 0
    # B=1: label chunks are views (nothing freed with them); the first chunk (j=0) has 1 scalar (the seed)
    ph1 = compiled_chunk_phases("torchtune-chunked-ce", B=1, S=S, V=V, logits_dtype="bfloat16")
    assert ph1.backward_start == {"logits_grad": 16000 + 32 + 8}
    assert "labels" not in ph1.forward


def test_lora_with_compiled_loss_estimates():
    # torchtune's LoRA recipe (compile=True: blocks and loss; full checkpointing) runs end to end; the
    # compiled loss keeps B*S*V*2 where the eager one keeps the fp32 log-softmax, B*S*V*4
    m = spec_from_hf_config(LLAMA)
    step = StepSpec(batch=B, seq=S, precision="bf16", loss="torchtune-chunked-ce")
    ft = FinetuneSpec(mode="lora", lora_rank=8, lora_alpha=16, lora_targets=("q_proj", "v_proj"), adapter_dtype="param")
    compiled = estimate(m, step, ImplSpec(device="cpu", compile=True, compile_scope="block-loss", recompute="full"),
                        finetune=ft)
    eager = estimate(m, step, ImplSpec(device="cpu", recompute="full"), finetune=ft)
    lsm = sum(i.bytes for i in eager.inventory.base if i.name.startswith("loss.log_softmax_chunk"))  # one per chunk
    kept = {i.name: i.bytes for i in compiled.inventory.base}
    assert lsm == B * S * V * 4 and kept["loss.logits"] == B * S * V * 2 and "loss.log_softmax" not in kept
    assert compiled.peak_bytes < eager.peak_bytes


@pytest.mark.slow
def test_against_torchtunes_compiled_chunk_function():
    """torchtune's chunked loss with compute_cross_entropy compiled alone, as compile_loss does,
    real inductor on CPU: autograd is handed exactly the estimate's loss items (distinct storages), and
    the generated code allocates per chunk (r, 1) fp32 buffers and the scalar in forward, one (r, 1)
    fp32 buffer and the bf16 (r, V) gradient in backward: no fp32 (r, V) buffer anywhere."""
    torch = pytest.importorskip("torch")
    from torch._inductor.utils import run_and_get_code

    from trainmem.trace.losses import _torchtune, chunk_cross_entropy

    chunk_ce = torch.compile(chunk_cross_entropy)  # training.compile_loss: compute_cross_entropy alone
    hidden = torch.randn(B, S, 16, dtype=torch.bfloat16, requires_grad=True)
    head = torch.randn(V, 16, dtype=torch.bfloat16)
    ids = torch.randint(0, V, (B, S))
    saved: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() != hidden.data_ptr() and t.data_ptr() != head.data_ptr():
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def step():
        logits = [c @ head.t() for c in hidden.chunk(8, dim=1)]  # TransformerDecoder.chunked_output
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = _torchtune(logits, ids, None, chunk_ce)  # CEWithChunkedOutputLoss.forward
        loss.backward()

    _, codes = run_and_get_code(step)
    # 258056: the loss items but loss.value, the output the caller holds, which autograd does not save
    assert sum(saved.values()) == sum(b for n, b in _loss_items().items() if n != "loss.value")
    r = B * S // 8
    allocs = [re.findall(r"empty_strided_cpu\((\([^)]*\)), \([^)]*\), torch\.(\w+)\)", c) for c in codes]
    assert allocs == [[(f"({r}, 1)", "float32"), (f"({r}, 1)", "float32"), ("()", "float32")],
                      [(f"({r}, 1)", "float32"), (f"({r}, {V})", "bfloat16")]]


QLORA = dict(mode="qlora", lora_rank=8, lora_alpha=16, lora_targets=("q_proj", "v_proj"), adapter_dtype="param",
             quant_impl="torchao-nf4")


def test_qlora_checkpointed_blocks_exact():
    # torchtune's QLoRA recipe with compile=True and full checkpointing, as its LoRA one
    # (tests/estimate/test_compiled_scope.py): each compiled block, wrapped in the checkpoint, keeps its
    # input (the embedding's output, block 0's output), the eager rotary cos/sin, the frozen final norm its
    # fp32 input and rsqrt, the compiled loss its items (test_saved_set_exact); no fp32 log-softmax
    ft = FinetuneSpec(**QLORA)
    items = activation_items(spec_from_hf_config(LLAMA), StepSpec(batch=B, seq=S, precision="bf16",
                                                                   loss="torchtune-chunked-ce"),
                             ImplSpec(device="cpu", compile=True, compile_scope="block-loss", recompute="full"),
                             finetune=ft)
    assert {i.name: i.bytes for i in items if i.bytes} == {
        "model.embed_tokens.out": 16384, "model.rotary_emb.cos": 2048, "model.rotary_emb.sin": 2048,
        "model.layers.0.residual_mlp": 16384, "model.norm.x_fp32": 32768, "model.norm.rsqrt": 512,
        "loss.logits": 256000, "loss.row_max": 512, "loss.logsumexp": 512, "loss.target": 1024, "loss.token_count": 8,
        "loss.value": 4}


@pytest.mark.parametrize("quant_impl", ["bnb", "bnb-legacy"])
def test_qlora_other_kernels_refused_under_compile(quant_impl):
    from trainmem.errors import UnsupportedError

    ft = FinetuneSpec(**{**QLORA, "quant_impl": quant_impl})
    with pytest.raises(UnsupportedError, match="finetune='qlora'"):
        activation_items(spec_from_hf_config(LLAMA), StepSpec(batch=B, seq=S, precision="bf16"),
                         ImplSpec(device="cpu", compile=True, compile_scope="block-loss", recompute="full"), finetune=ft)


@pytest.mark.slow
def test_compiled_checkpointed_nf4_block_keeps_its_input():
    """A block of torchao NF4 linears with LoRA adapters, compiled (torchtune's compile_model) and wrapped
    in a non-reentrant checkpoint (set_activation_checkpointing), real inductor on CPU: autograd is handed
    the block's input only, and the backward runs."""
    torch = pytest.importorskip("torch")
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class QLoRALinear(nn.Module):
        def __init__(self, i, o):
            super().__init__()
            self.weight = nn.Parameter(nf4.to_nf4(torch.randn(o, i, dtype=torch.bfloat16)), requires_grad=False)
            self.a = nn.Parameter(torch.randn(8, i, dtype=torch.bfloat16) / 16)
            self.b = nn.Parameter(torch.zeros(o, 8, dtype=torch.bfloat16))

        def forward(self, x):  # torchtune's LoRALinear: linear_nf4 of the frozen base plus the adapter path
            return nf4.linear_nf4(x, self.weight) + (x @ self.a.t()) @ self.b.t()

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.up, self.down = QLoRALinear(128, 128), QLoRALinear(128, 256), QLoRALinear(256, 128)

        def forward(self, x):
            h = x + self.q(x)
            return h + self.down(torch.nn.functional.silu(self.up(h)))

    block = Block()
    block.compile()
    x = torch.randn(2, 32, 128, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = checkpoint(block, x, use_reentrant=False)
    assert [(tuple(t.shape), t.dtype) for t in saved] == [((2, 32, 128), torch.bfloat16)]
    y.sum().backward()
    assert x.grad is not None and block.q.a.grad is not None
