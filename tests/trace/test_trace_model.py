"""trace_model: your own nn.Module on fake tensors, a warm-up step and a recorded second step."""

import re
import resource
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainmem.errors import SpecError, UnsupportedError
from trainmem.trace import trace_model


class MLP(nn.Module):
    def __init__(self, d: int = 128, h: int = 256) -> None:
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """A pre-norm Transformer block: causal SDPA attention and a SwiGLU MLP."""

    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d)
        self.gate_up = nn.Linear(d, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, S, hd)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, ffn: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_step(model, optimizer, ids):
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def mlp_step(model, optimizer, x):
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_mlp_peak_is_exact_and_holds_the_optimizer_state():
    r = trace_model(MLP, mlp_step, batch_factory=lambda: torch.randn(16, 128))
    # parameters: up 256·128·4 + 256·4, down 128·256·4 + 128·4 = 131072 + 1024 + 131072 + 512 = 263680
    p = 263680
    t = r.totals_at_peak_bytes
    assert (t["parameter"], t["gradient"], t["optimizer_state"]) == (p, p, 2 * p)  # exp_avg, exp_avg_sq
    assert t["transient"] == p  # foreach AdamW's _foreach_sqrt(exp_avg_sq): one per parameter
    assert t["input"] == 16 * 128 * 4  # = 8192
    assert t["activation"] == 0  # mlp_step binds no name to the loss: freed after backward
    # 5·263680 + 8192 = 1326592
    assert r.peak_bytes == 1326592
    assert (r.peak_phase, r.peak_op) == ("optimizer", "_foreach_sqrt")
    assert r.meta["fake"] and r.meta["optimizer"] == "AdamW"


def test_mlp_fake_equals_real_second_step():
    kw = dict(batch_factory=lambda: torch.randn(16, 128))
    fake, real = trace_model(MLP, mlp_step, **kw), trace_model(MLP, mlp_step, real=True, **kw)
    assert not real.meta["fake"]
    assert fake.peak_bytes == real.peak_bytes == 1326592
    assert fake.totals_at_peak_bytes == real.totals_at_peak_bytes
    assert fake.timeline_allocated_bytes == real.timeline_allocated_bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformer_block_fake_equals_real(dtype):
    kw = dict(batch_factory=lambda: torch.randint(0, 512, (2, 64)), dtype=dtype,
              optimizer_factory=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False))
    build = lambda: TinyLM(vocab=512, d=128, heads=4, ffn=256, layers=2)  # noqa: E731
    fake, real = trace_model(build, lm_step, **kw), trace_model(build, lm_step, real=True, **kw)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.totals_at_peak_bytes == real.totals_at_peak_bytes
    assert fake.peak_reserved_bytes == real.peak_reserved_bytes
    n = sum(p.numel() for p in build().parameters())
    elem = 4 if dtype == "float32" else 2
    assert fake.totals_at_peak_bytes["optimizer_state"] >= 2 * n * elem  # the warm-up made the state


@pytest.mark.slow
def test_a_7b_shaped_model_traces_without_its_memory():
    """Llama-2-7B's shapes (32 blocks, d 4096, 32 heads, SwiGLU 11008, vocab 32000), fp32: the
    trace holds no weights (fp32 parameters alone would be 27 GB of host memory)."""
    build = lambda: TinyLM(vocab=32000, d=4096, heads=32, ffn=11008, layers=32)  # noqa: E731
    r = trace_model(build, lm_step, batch_factory=lambda: torch.randint(0, 32000, (1, 256)),
                    optimizer_factory=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True))
    # per block 4096·3·4096 + 4096·4096 + 4096·2·11008 + 11008·4096 + 2·4096 = 202,383,360;
    # ·32 + embed and head 2·32000·4096 + final norm 4096 = 6,476,267,520 + 262,144,000 + 4096
    n = 6_738_415_616
    t = r.totals_at_peak_bytes
    assert t["parameter"] == 4 * n
    assert t["optimizer_state"] == 2 * 4 * n
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 8 * 2**20  # KiB: under 8 GiB


def test_item_in_step_fn_is_one_line_error():
    def step(model, optimizer, x):
        loss = model(x).square().mean()
        print(loss.item())

    with pytest.raises(UnsupportedError, match="step_fn") as info:
        trace_model(MLP, step, batch_factory=lambda: torch.randn(4, 128))
    assert "\n" not in str(info.value) and "real=True" in str(info.value)


def test_bad_arguments_are_named():
    with pytest.raises(SpecError, match="dtype"):
        trace_model(MLP, mlp_step, dtype="fp8")
    with pytest.raises(UnsupportedError, match="model_factory"):
        trace_model(MLP(), mlp_step)


def test_repr_html():
    r = trace_model(MLP, mlp_step, batch_factory=lambda: torch.randn(16, 128))
    page = r._repr_html_()
    assert "trainmem trace: MLP" in page and "<svg" in page and "<script" not in page
    assert "1.27 MiB" in page  # the peak, 1326592 bytes


def test_readme_custom_model_example_runs():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "trace_model(" in b]
    assert len(blocks) == 1
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)  # noqa: S102
    assert scope["result"].peak_bytes > 0 and scope["result"].meta["fake"]
