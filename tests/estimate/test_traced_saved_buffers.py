"""``--profile traced`` and the registered buffers autograd saves as they are.

BERT's and DeBERTa-v2's position embeddings save a slice of the ``position_ids`` buffer (transformers
``modeling_bert.py`` / ``modeling_deberta_v2.py`` ``*Embeddings.forward``: ``self.position_ids[:, :S]``);
MiniMax's lightning attention multiplies by its ``diagonal_decay``, ``query_decay`` and ``key_decay``
buffers (``modeling_minimax.py`` ``MiniMaxLightningAttention.forward``), and the products save slices of
them. Those storages are the buffers' own, allocated before the step: the estimate counts each once, as a
buffer item (estimate/buffers.py), never as an activation (traced/record.py ``_one``, since 33bd02e), as
``trainmem trace`` files them. So the traced activations equal what autograd saves without the model's
buffers (``saved_tensors(..., buffers=False)``), plus the loss the caller holds (``loss.value``), to the
byte; and every buffer autograd saves is one of the estimate's buffer items at its full size: BERT's family
declares them, an unmapped model type's are read off the model (traced/buffers.py). Since 33bd02e left
saved buffers out of the activations, DeBERTa-v2's ``position_ids`` and MiniMax's decay tables were
counted nowhere: the generic family's buffers (Llama's rotary pair) stood in for them.

Tiny configs (hidden 64, 2 blocks, vocabulary 512, B=2, S=32), real CPU forward for the ground truth; the
buffer ledger alone (no trace) against a real build's ``named_buffers()`` in both precisions, fast.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from trainmem.estimate import estimate  # noqa: E402
from trainmem.estimate.traced import unmapped_model_spec  # noqa: E402
from trainmem.models.hf import build_hf_model  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import load_model  # noqa: E402
from trainmem.trace.saved import saved_tensors  # noqa: E402
from trainmem.trace.torch_state import default_dtype  # noqa: E402

pytestmark = pytest.mark.usefixtures("traced_cache")  # one TRAINMEM_CACHE per session: tests/conftest.py

B, S = 2, 32
_ENCODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512,
                max_position_embeddings=512, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
#: family -> (config, attention, precision): the three families whose bench row moved with 33bd02e
CASES = {
    "bert": (dict(_ENCODER, model_type="bert"), "sdpa", "fp32"),
    "deberta-v2": (dict(_ENCODER, model_type="deberta-v2"), "eager", "bf16"),  # no SDPA path in transformers 5.x
    "minimax": (dict(model_type="minimax", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
                     pad_token_id=0, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                     layer_types=["full_attention", "linear_attention"]), "sdpa", "bf16"),
}


def _real(cfg: dict, precision: str, attention: str) -> tuple[int, dict[str, int]]:
    """Autograd's saved bytes without the model's buffers, plus the loss; and {buffer name: bytes} of
    every registered buffer whose storage autograd packed."""
    import contextlib

    from trainmem.specs.impl import routing_hot_fraction
    from trainmem.trace.routing import experts_modules, force_routing

    torch.manual_seed(0)
    with default_dtype(torch.bfloat16 if precision == "bf16" else torch.float32):  # as trace_step builds it
        model = build_hf_model(cfg, attention=attention)
    ids = torch.randint(0, cfg["vocab_size"], (B, S))
    buffers = {b.untyped_storage()._cdata: (n, b.untyped_storage().nbytes()) for n, b in model.named_buffers()}
    packed: dict[str, int] = {}

    def pack(t):
        hit = buffers.get(t.untyped_storage()._cdata)
        if hit is not None:
            packed[hit[0]] = hit[1]
        return t

    forced = force_routing(model, routing_hot_fraction("balanced")) if experts_modules(model) else None
    with forced or contextlib.nullcontext():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # hooks do not nest: a forward of its own
            model(ids, labels=ids).loss
        saved, loss = saved_tensors(model, lambda: model(ids, labels=ids).loss, buffers=False)
    return sum(s.nbytes for s in saved) + loss.untyped_storage().nbytes(), packed


def _traced(tmp_path, cfg: dict, precision: str, attention: str):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = unmapped_model_spec(str(path)) or load_model(str(path))
    return estimate(spec, StepSpec(batch=B, seq=S, precision=precision),
                    ImplSpec(profile="traced", device="cpu", attention=attention, routing="balanced"))


@pytest.mark.slow  # ~4-8 s each on the shared cores: two real forwards and a traced fit
@pytest.mark.parametrize("family", list(CASES))
def test_traced_activations_leave_saved_buffers_out(tmp_path, family):
    cfg, attention, precision = CASES[family]
    activations, packed = _real(cfg, precision, attention)
    assert packed, "the family no longer saves a buffer: this test pins nothing"
    assert _traced(tmp_path, cfg, precision, attention).totals_bytes["activation"] == activations


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CASES))
def test_saved_buffers_are_buffer_items(tmp_path, family):
    cfg, attention, precision = CASES[family]
    _, packed = _real(cfg, precision, attention)
    items = {i.name: i for i in _traced(tmp_path, cfg, precision, attention).inventory.items}
    for name, nbytes in packed.items():
        assert name in items and items[name].category.value == "buffer" and items[name].bytes == nbytes, name


#: unmapped model types whose buffers the generic family's guess (Llama's ``model.rotary_emb`` pair) got wrong:
#: other names (falcon's ``transformer.rotary_emb``, olmo3's and modernbert's per attention type), other
#: widths (phi's partial rotary), none at all (t5), or others besides (roberta's ids, glm4_moe's router bias)
OTHERS = ("t5", "falcon", "olmo3", "modernbert", "phi", "roberta", "glm4_moe")


@pytest.mark.parametrize("family, precision", [(f, p) for f in ("deberta-v2", "minimax") for p in ("fp32", "bf16")]
                         + [(f, "bf16") for f in OTHERS])
def test_unmapped_buffer_items_are_the_models_own(tmp_path, family, precision):
    """The buffer ledger alone (no trace): the names, shapes, dtypes and bytes of a real build's named_buffers()."""
    import sys
    from pathlib import Path

    from trainmem.estimate.buffers import buffer_items

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trace"))
    from tiny_families import FAMILIES

    cfg = CASES[family][0] if family in CASES else FAMILIES[family]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = unmapped_model_spec(str(path))
    assert spec is not None and spec.family == "generic"
    with default_dtype(torch.bfloat16 if precision == "bf16" else torch.float32):  # as trace_step builds it
        model = build_hf_model(cfg, attention="eager")
    real = {n: (tuple(b.shape), str(b.dtype).removeprefix("torch."), b.nelement() * b.element_size())
            for n, b in model.named_buffers()}
    items = buffer_items(spec, StepSpec(batch=B, seq=S, precision=precision), "traced")
    assert {i.name: (i.shape, i.dtype, i.bytes) for i in items} == real
