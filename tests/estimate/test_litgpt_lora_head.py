"""LoRA on LitGPT's chunked head (``--framework litgpt --loss litgpt-chunked-ce``, ``lm_head`` in
``--lora-targets``; bench/published litgpt-hub tinyllama/gemma-2b/phi-3 LoRA rows).

litgpt 0.5.13's ``lora.GPT`` with ``lora_head=True`` makes ``lm_head`` a ``LoRALinear`` (litgpt/lora.py
``GPT.__init__``), run once per 128-token split (litgpt/model.py ``GPT.forward(lm_head_chunk_size=128)``):
its adapters ``lora_A`` (r, H) and ``lora_B`` (V, r) train (gradient, AdamW states), and each chunk's
``LoRALinear.forward`` keeps the dropout mask, the dropout output and the rank-r product, all chunk-sized
(at B=1 the chunk is a view of the head input). Inside the last chunk's forward the frozen output, the
scaled adapter output and their sum are alive beside the earlier chunks' logits, the head input and the
loop's previous ``logits`` (litgpt/finetune/lora.py ``fit`` keeps them bound until the new forward returns,
across optimizer steps too): with a LoRA head that moment tops the loss backward at these shapes.
The slow test runs the real model on CPU (bf16, foreach AdamW, litgpt's ``chunked_cross_entropy``) in
``fit``'s loop, the previous step's logits held, and holds the estimate's step peak to the live-storage
peak (trace/live.py ``LiveStorages``, the held logits in its baseline).
"""

from __future__ import annotations

import pytest

H, A, KV, F, V, L, R, S = 256, 4, 2, 512, 4096, 2, 8, 256


def _estimate(B: int, head: bool, dropout: float, accum: int = 1):
    from trainmem.estimate import estimate
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.finetune import FinetuneSpec
    from trainmem.specs.loaders import spec_from_hf_config

    cfg = dict(model_type="llama", hidden_size=H, intermediate_size=F, num_hidden_layers=L, num_attention_heads=A,
               num_key_value_heads=KV, vocab_size=V)
    ft = FinetuneSpec(mode="lora", lora_rank=R, lora_alpha=16, adapter_dtype="param", lora_dropout=dropout,
                      lora_targets=("q_proj", "v_proj") + (("lm_head",) if head else ()))
    step = StepSpec(batch=B, seq=S, precision="bf16", optimizer="adamw", loss="litgpt-chunked-ce", grad_accum=accum)
    return estimate(spec_from_hf_config(cfg), step, ImplSpec(device="cpu", framework="litgpt", optimizer_impl="foreach"),
                    finetune=ft)


def test_lora_head_adapters_train():
    """lm_head.lora_A (8, 256) and lora_B (4096, 8), bf16: parameter, gradient and two AdamW states each."""
    items = {i.name: i.bytes for i in _estimate(2, True, 0.05).inventory if ".lora_" in i.name and "lm_head" in i.name}
    a, b = R * H * 2, V * R * 2  # 4,096 and 65,536
    assert {n: v for n, v in items.items() if not n.startswith("lm_head.lora_dropout")
            and not n.endswith(".out")} == {
        "lm_head.lora_A.default.weight": a, "lm_head.lora_A.default.weight.grad": a,
        "lm_head.lora_A.default.weight.exp_avg": a, "lm_head.lora_A.default.weight.exp_avg_sq": a,
        "lm_head.lora_B.default.weight": b, "lm_head.lora_B.default.weight.grad": b,
        "lm_head.lora_B.default.weight.exp_avg": b, "lm_head.lora_B.default.weight.exp_avg_sq": b}


@pytest.mark.parametrize("B", [1, 2])
def test_lora_head_keeps_chunk_sized_tensors(B):
    """Per 128-token chunk: the bf16 dropout mask and output (B, 128, H) and the rank-r product (B, 128, r);
    at B=1 the chunk is a view of the head input, not the whole of it."""
    kept = sum(i.bytes for i in _estimate(B, True, 0.05).inventory
               if i.name.startswith("lm_head.lora_") and i.category.value == "activation")
    # 2 chunks x (2 x B*128*256*2 + B*128*8*2) = B x 266,240
    assert kept == 2 * (2 * B * 128 * H * 2 + B * 128 * R * 2) == B * 266_240


def _real(B: int, dropout: float, accum: int) -> int:
    torch = pytest.importorskip("torch")
    lora = pytest.importorskip("litgpt.lora")
    from litgpt.utils import chunked_cross_entropy

    from trainmem.trace.live import LiveStorages

    torch.manual_seed(0)
    config = lora.Config(name="tiny", n_layer=L, n_embd=H, n_head=A, n_query_groups=KV, intermediate_size=F,
                         block_size=S, mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", bias=False,
                         parallel_residual=False, rotary_percentage=1.0, padded_vocab_size=V, vocab_size=V,
                         lora_r=R, lora_alpha=16, lora_dropout=dropout, lora_query=True, lora_value=True,
                         lora_head=True)
    model = lora.GPT(config).to(torch.bfloat16)
    lora.mark_only_lora_as_trainable(model)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
    ids, targets = torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))
    loop = {}  # fit's locals: logits stay bound until the next forward returns

    def step():  # litgpt/finetune/lora.py fit, one optimizer step
        for _ in range(accum):
            loop["logits"] = logits = model(ids, lm_head_chunk_size=128)
            logits[-1] = logits[-1][..., :-1, :]
            (chunked_cross_entropy(logits, targets[..., 1:]) / accum).backward()
        opt.step()
        opt.zero_grad()

    step()  # the optimizer state and the previous step's logits exist from here on
    live = LiveStorages([*model.parameters(), *model.buffers(), *loop["logits"],
                         *(v for state in opt.state.values() for v in state.values())])
    with live:  # (a list of the baseline kept here would keep the old logits alive)
        step()
    return live.peak


@pytest.mark.slow
@pytest.mark.parametrize("B,dropout,accum", [(1, 0.05, 1), (2, 0.05, 1), (2, 0.0, 1), (2, 0.05, 2)])
def test_lora_head_matches_real_litgpt(B, dropout, accum):
    est, real = _estimate(B, True, dropout, accum), _real(B, dropout, accum)
    assert est.peak.name == "forward" and "LoRA head chunk" in est.peak.note, est.peak
    # measured: the estimate is 5,912 B under at grad-accum 1 (B=1 and 2), 10,010 B at 2 (without the
    # head, LitGPT LoRA's backward_start is 8·B·S + 5,906 B under; not the head's, not looked into here)
    assert 0 <= real - est.peak_bytes <= 4e-4 * real, (est.peak_bytes, real)
