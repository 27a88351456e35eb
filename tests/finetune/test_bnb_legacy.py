"""--quant-impl bnb-legacy: bitsandbytes < 0.43.2's MatMul4Bit holds each 4-bit linear's input.

bitsandbytes 0.41-0.43.1 ``MatMul4Bit.forward`` (``bitsandbytes/autograd/_functions.py``) sets
``ctx.tensors = (A, B)`` when the input needs a gradient; 0.43.2 (PR #1270) sets ``(None, B)``.
Old bitsandbytes has no CPU kernels, so the old function cannot run here. What is checked on CPU,
with bitsandbytes 0.50.2's real ``Linear4bit`` under peft: the estimate's legacy saved set equals
the storages autograd really saves plus every ``Linear4bit`` input that requires a gradient (the
``A`` the old ``ctx.tensors`` held), de-duplicated by storage -- both sides at the byte.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

from test_qlora_bnb import CFG, _quantize  # noqa: E402  (same directory: rootdir import mode)

from trainmem.errors import UnsupportedError  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.estimate.activations import activation_items  # noqa: E402
from trainmem.estimate.bnb_legacy import HELD_NOTE  # noqa: E402
from trainmem.models.hf import build_hf_model  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.finetune import FinetuneSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402
from trainmem.trace.storages import is_parameter, parameter_storage_keys  # noqa: E402

B, S = 2, 32


def _saved_plus_4bit_inputs(model, ids) -> tuple[int, int]:
    """(bytes autograd saves, bytes of that set united with every Linear4bit input needing a grad)."""
    params = parameter_storage_keys(model)
    saved: dict[int, int] = {}
    inputs: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params and not is_parameter(t):
            saved.setdefault(st._cdata, st.nbytes())
        return t

    alive = []  # held here as the old ctx.tensors held them: a freed storage's key could be reused

    def pre(module, args):
        x = args[0]
        if x.requires_grad:  # Linear4bit.forward: x.to(compute_dtype) is x itself in a bf16 model
            alive.append(x)
            inputs.setdefault(x.untyped_storage()._cdata, x.untyped_storage().nbytes())

    hooks = [m.register_forward_pre_hook(pre) for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    for h in hooks:
        h.remove()
    loss.backward()
    del alive
    held = loss.untyped_storage().nbytes()  # the loss the caller holds (not saved): the item loss.value
    return sum(saved.values()) + held, sum({**saved, **inputs}.values()) + held


@pytest.mark.parametrize("targets,dropout", [(("q_proj", "v_proj"), 0.1),
                                             pytest.param(("all-linear",), 0.0, marks=pytest.mark.slow)])
def test_legacy_saved_set_is_the_real_saved_set_plus_the_4bit_inputs(targets, dropout):
    torch.manual_seed(0)
    base = build_hf_model(CFG, dtype=torch.bfloat16)
    _quantize(base, double_quant=True)
    base.requires_grad_(False)
    names = "all-linear" if targets == ("all-linear",) else list(targets)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=names, lora_dropout=dropout))
    model.train()
    ids = torch.randint(0, CFG["vocab_size"], (B, S))
    real_now, real_legacy = _saved_plus_4bit_inputs(model, ids)
    spec, step, impl = spec_from_hf_config(CFG), StepSpec(batch=B, seq=S, precision="bf16"), ImplSpec(device="cpu")
    now = FinetuneSpec(mode="qlora", lora_rank=8, lora_alpha=16, lora_targets=targets, lora_dropout=dropout)
    legacy = FinetuneSpec(**{**now.to_dict(), "lora_targets": targets, "quant_impl": "bnb-legacy"})
    acts_now = activation_items(spec, step, impl, now)
    acts_legacy = activation_items(spec, step, impl, legacy)
    assert sum(i.bytes for i in acts_now) == real_now
    assert sum(i.bytes for i in acts_legacy) == real_legacy
    assert real_legacy > real_now
    # the held inputs stay through the whole backward: backward_end keeps every one of them
    held = sum(i.bytes for i in acts_legacy if i.note == HELD_NOTE)
    ends = [{p.name: p.bytes for p in estimate(spec, step, impl, finetune=f).phases}["backward_end"]
            for f in (now, legacy)]
    assert ends[1] - ends[0] == held
    # same storage as bnb: the parameters are the same bytes
    assert (estimate(spec, step, impl, finetune=now).totals_bytes["parameter"]
            == estimate(spec, step, impl, finetune=legacy).totals_bytes["parameter"])


def test_legacy_under_checkpointing_is_refused():
    spec = spec_from_hf_config(CFG)
    ft = FinetuneSpec(mode="qlora", lora_targets=("q_proj", "v_proj"), quant_impl="bnb-legacy")
    with pytest.raises(UnsupportedError, match="bnb-legacy"):
        estimate(spec, StepSpec(batch=B, seq=S, precision="bf16"), ImplSpec(device="cpu", recompute="full"),
                 finetune=ft)


def test_litgpt_loop_holds_the_previous_graph():
    """--loss litgpt-chunked-ce is LitGPT's loop, which keeps logits and loss (so the graph) bound into
    the next forward: the end of forward holds the previous step's held inputs too, the optimizer
    step this step's."""
    spec = spec_from_hf_config(CFG)
    step = StepSpec(batch=B, seq=S, precision="bf16", loss="litgpt-chunked-ce")
    impl = ImplSpec(device="cpu")
    now = FinetuneSpec(mode="qlora", lora_targets=("q_proj", "v_proj"))
    legacy = FinetuneSpec(mode="qlora", lora_targets=("q_proj", "v_proj"), quant_impl="bnb-legacy")
    acts = activation_items(spec, step, impl, legacy)
    held = sum(i.bytes for i in acts if i.note == HELD_NOTE)  # some (SDPA's output) are kept anyway
    added = sum(i.bytes for i in acts) - sum(i.bytes for i in activation_items(spec, step, impl, now))
    a, b = ({p.name: p.bytes for p in estimate(spec, step, impl, finetune=f).phases} for f in (now, legacy))
    assert held > added > 0
    assert b["forward"] - a["forward"] == added + held
    assert b["optimizer"] - a["optimizer"] == held
