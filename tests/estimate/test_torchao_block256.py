"""``--optimizer torchao-adamw4bit-block256``: torchao's ``AdamW4bit(block_size=256)``, what
transformers' ``adamw_torch_4bit`` builds (``trainer_optimizer.py`` ``_get_torchao_optimizer`` passes
``block_size=optim_args.get("block_size", 256)``; torchao's own default is 128).

The layout against the real optimizer's states on CPU (as tests/estimate/test_optimizers_8bit.py
checks the default block), and the compiled step's buffers measured as
tests/estimate/test_torchao_step_measured.py measures them (slow).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
ao = pytest.importorskip("torchao.optim")

from test_optimizers_8bit import CFG, MODEL, _storage_bytes  # noqa: E402

from trainmem.estimate.model_states import model_state_items  # noqa: E402
from trainmem.estimate.optimizer_step import Stepped, step_temporaries  # noqa: E402
from trainmem.estimate.state_items import optimizer_state_items  # noqa: E402
from trainmem.inventory import Category  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402

OPT = "torchao-adamw4bit-block256"


@pytest.mark.parametrize("shape,total", [
    ((4096,), 2 * (4096 // 2 + 16 * 4 + 16 * 4)),  # two codes a byte, 16 scales of 256 values, 16-entry qmap
    ((44160,), 2 * 44160 * 4),  # 44160 % 256 != 0: fp32 zeros_like (the 128-value block quantizes it)
    ((128000,), 2 * (64000 + 500 * 4 + 16 * 4)),
])
def test_layout_bytes(shape, total):
    items = optimizer_state_items("w", shape, StepSpec(optimizer=OPT, precision="fp32"))
    assert sum(i.bytes for i in items) == total


def test_states_equal_the_real_optimizer():
    from trainmem.models.hf import build_hf_model
    torch.manual_seed(0)
    model = build_hf_model(CFG, attention="sdpa")
    opt = ao.AdamW4bit(list(model.parameters()), lr=1e-4, block_size=256)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    with torch.compiler.set_stance("force_eager"):  # the same states, without inductor's C++ build
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    real = {names[id(p)]: sum(n for k, v in s.items() if k != "step" for n in _storage_bytes(v).values())
            for p, s in opt.state.items()}
    est: dict[str, int] = {}
    for i in model_state_items(MODEL, StepSpec(optimizer=OPT, precision="fp32")):
        if i.category is Category.OPTIMIZER_STATE:
            owner = next(n for n in real if i.name.startswith(n + "."))
            est[owner] = est.get(owner, 0) + i.bytes
    assert est == real  # embed/lm_head quantized (128000 = 500 blocks), gate/up/down (44160) not


def test_the_trainer_builds_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    from trainmem.integrations.read import optimizer_of, trainer_optim_of
    args = transformers.TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_4bit", use_cpu=True)
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args)
    built = cls([torch.nn.Parameter(torch.zeros(8))], **kwargs)
    assert optimizer_of(built, device="cuda").value == (OPT, "auto") == trainer_optim_of(
        "adamw_torch_4bit", None, device="cuda").value
    assert optimizer_of(ao.AdamW4bit([torch.nn.Parameter(torch.zeros(8))]), device="cuda").value == (
        "torchao-adamw4bit", "auto")  # torchao's default block


@pytest.mark.slow  # compiles inductor's C++ kernel (40-80 s on two loaded cores)
def test_compiled_step_holds_what_the_rule_says():
    from trainmem.measure_dist.worker import _profiled_peak
    torch.manual_seed(0)
    n = 256 * 2048  # bf16 values, a multiple of the block
    p = torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16).view(256, 2048))
    optim = ao.AdamW4bit([p], lr=1e-3, block_size=256)
    for i in range(3):  # the first makes the states and compiles, the third is measured
        p.grad = torch.randn_like(p)
        measured = _profiled_peak(optim.step) if i == 2 else optim.step()
    want, rule = step_temporaries(StepSpec(optimizer=OPT, precision="bf16"), ImplSpec(device="cpu"),
                                  Stepped(n * 2, (n * 2,), 2))
    # n·(2·1 + 2·4 + 2·8) + 2·(n/256)·4 = 13,631,488 + 16,384 = 13,647,872
    assert want == 13_647_872, rule
    assert measured == want, rule
