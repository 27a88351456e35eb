"""Task heads (``--head seq-cls|token-cls``) against real transformers models on CPU.

Measured: the saved set with ``saved_tensors_hooks`` (distinct storages, parameters excluded) on
models built by transformers' own Auto classes, and the parameters they hold. Both must equal the
estimate to the byte; the fake-tensor trace must equal the real-tensor trace to the byte.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from trainmem.errors import SpecError  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.estimate.activations import activation_items  # noqa: E402
from trainmem.estimate.heads import head_parameters  # noqa: E402
from trainmem.estimate.params import parameter_shapes  # noqa: E402
from trainmem.models.hf import build_hf_model  # noqa: E402
from trainmem.specs import ImplSpec, ModelSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402
from trainmem.trace.saved import saved_tensors  # noqa: E402

B, S = 2, 16
SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, vocab_size=500)
CONFIGS = {
    "llama": dict(model_type="llama", num_key_value_heads=2, **SMALL),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=64),
    "gpt_neox": dict(model_type="gpt_neox", **SMALL),
    "bert": dict(model_type="bert", max_position_embeddings=64, **SMALL),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, **SMALL),
    "phi3": dict(model_type="phi3", num_key_value_heads=2, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, **SMALL),
    "mixtral": dict(model_type="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **SMALL),
}
DTYPES = {"bf16": torch.bfloat16}


class _StateOf:
    """The model's resident tensors as ``saved_tensors`` excludes them: parameters and buffers
    (BERT's position ids are a slice of its ``position_ids`` buffer, allocated once, not per step)."""

    def __init__(self, model):
        self.model = model

    def parameters(self):
        return [*self.model.parameters(), *self.model.buffers()]

    def modules(self):
        return self.model.modules()


def _measure(cfg: dict, head: str, precision: str, num_labels: int):
    torch.manual_seed(0)
    model = build_hf_model({**cfg, "num_labels": num_labels}, head=head, dtype=DTYPES.get(precision))
    ids = torch.randint(1, cfg["vocab_size"], (B, S))
    labels = torch.randint(0, num_labels, (B,) if head == "seq-cls" else (B, S))

    def forward():
        if precision == "amp-bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(input_ids=ids, labels=labels).loss
        return model(input_ids=ids, labels=labels).loss

    saved, loss = saved_tensors(_StateOf(model), forward)
    loss.backward()  # the saved set was enough
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return saved, params, loss.untyped_storage().nbytes()  # the loss the caller holds: loss.value


QUICK = {("llama", "token-cls", "bf16"), ("bert", "seq-cls", "amp-bf16")}  # the rest: -m slow
CASES = [pytest.param(f, h, p, marks=() if (f, h, p) in QUICK else pytest.mark.slow)
         for f in CONFIGS for h in ("seq-cls", "token-cls") for p in ("fp32", "bf16", "amp-bf16")]


@pytest.mark.parametrize("family,head,precision", CASES)
def test_head_saved_set_and_parameters_match_transformers(family, head, precision):
    num_labels = 3
    saved, params, held = _measure(CONFIGS[family], head, precision, num_labels)
    spec = replace(spec_from_hf_config(CONFIGS[family]), head=head, num_labels=num_labels)
    step, impl = StepSpec(batch=B, seq=S, precision=precision), ImplSpec(device="cpu", attention="sdpa")
    acts = activation_items(spec, step, impl)
    assert sum(i.bytes for i in acts) == sum(s.nbytes for s in saved) + held, sorted((s.shape, s.dtype) for s in saved)
    assert estimate(spec, step, impl).totals_bytes["parameter"] == params


def test_head_parameters_exact():
    spec = replace(spec_from_hf_config(CONFIGS["llama"]), head="token-cls", num_labels=9)
    names = [n for n, _ in parameter_shapes(spec)]
    assert "lm_head.weight" not in names and names[-2:] == ["score.weight", "score.bias"]
    bert = replace(spec_from_hf_config(CONFIGS["bert"]), head="seq-cls", num_labels=2)
    tail = head_parameters(bert, [])
    # 64·64 + 64 (pooler) + 2·64 + 2 (classifier)
    assert sum(int(torch.tensor(s).prod()) for _, s in tail) == 4096 + 64 + 128 + 2
    assert not any(n.startswith("cls.") for n, _ in parameter_shapes(bert))


def test_seq_cls_keeps_no_vocabulary_logits():
    spec = replace(spec_from_hf_config(CONFIGS["llama"]), head="seq-cls", num_labels=2)
    items = {i.name: i for i in activation_items(spec, StepSpec(batch=B, seq=S, precision="fp32"), ImplSpec())}
    # cross-entropy over the pooled (B, num_labels) logits: 2·2·4 = 16 bytes; the indices 2·8 each
    assert items["loss.log_softmax"].bytes == 16
    assert items["score.pool.batch_index"].bytes == items["score.pool.last_non_pad_token"].bytes == 16


@pytest.mark.slow
@pytest.mark.parametrize("family,head", [("llama", "token-cls"), ("bert", "seq-cls")])
def test_fake_trace_equals_real_trace(family, head):
    from trainmem.trace import trace_step

    step = StepSpec(batch=B, seq=S, precision="fp32")
    cfg = {**CONFIGS[family], "num_labels": 3}
    fake = trace_step(cfg, step, ImplSpec(device="cpu"), head=head)
    real = trace_step(cfg, step, ImplSpec(device="cpu"), head=head, real=True)
    assert fake.peak_bytes == real.peak_bytes


def test_head_refusals():
    with pytest.raises(SpecError, match="head"):
        ModelSpec(hidden_size=64, num_layers=2, num_heads=4, ffn_size=128, vocab_size=100, head="mlm")
    with pytest.raises(SpecError, match="num_labels"):
        ModelSpec(hidden_size=64, num_layers=2, num_heads=4, ffn_size=128, vocab_size=100, head="seq-cls",
                  num_labels=0)
    spec = replace(spec_from_hf_config(CONFIGS["llama"]), head="seq-cls")
    with pytest.raises(SpecError, match="loss"):
        estimate(spec, StepSpec(batch=B, seq=S, loss="chunked-ce"), ImplSpec())
    from trainmem.specs.finetune import FinetuneSpec
    with pytest.raises(SpecError, match="modules_to_save"):
        estimate(spec, StepSpec(batch=B, seq=S), ImplSpec(), finetune=FinetuneSpec(mode="lora"))
    full = estimate(spec, StepSpec(batch=B, seq=S), ImplSpec(), finetune=FinetuneSpec(freeze=("embeddings",)))
    assert full.totals_bytes["gradient"] < estimate(spec, StepSpec(batch=B, seq=S), ImplSpec()).totals_bytes["gradient"]


def test_config_names_its_head_as_the_trace_builds_it():
    """``architectures`` and ``id2label`` choose the head and its classes for the estimate as for
    the built model (models/hf.py choose_head); ``classifier_dropout`` is read too."""
    cfg = {**CONFIGS["bert"], "architectures": ["BertForTokenClassification"], "classifier_dropout": 0.2,
           "id2label": {"0": "O", "1": "B-PER", "2": "I-PER", "3": "B-LOC"}}
    spec = spec_from_hf_config(cfg)
    assert (spec.head, spec.num_labels, spec.classifier_dropout) == ("token-cls", 4, 0.2)
    torch.manual_seed(0)
    model = build_hf_model(cfg)
    assert type(model).__name__ == "BertForTokenClassification" and model.dropout.p == 0.2
    ids, labels = torch.randint(1, 500, (B, S)), torch.randint(0, 4, (B, S))
    saved, loss = saved_tensors(_StateOf(model), lambda: model(input_ids=ids, labels=labels).loss)
    acts = activation_items(spec, StepSpec(batch=B, seq=S, precision="fp32"), ImplSpec(device="cpu"))
    assert sum(i.bytes for i in acts) == sum(s.nbytes for s in saved) + loss.untyped_storage().nbytes()
