"""``--profile traced`` on BART (two stacks, learned positions): activations equal the bytes
autograd saves in a real CPU forward, to the byte, fp32 and bf16, eager and SDPA.

Under SDPA BART's decoder makes its own all-ones padding mask (transformers ``modeling_bart.py``
``BartDecoder.forward``); on fake tensors ``masking_utils._ignore_causal_mask_sdpa`` cannot read
it and a (B, 1, S, S) mask was materialized that the real run skips (+8,192 B bf16, +16,384 B
fp32 at B2 S32). ``trace/hf_masks.py`` asks the skip on a real all-ones mask. Tiny config
(d_model 64, 2 + 2 blocks); each case traces and builds BART: slow.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from trainmem.estimate import estimate  # noqa: E402
from trainmem.estimate.traced import unmapped_model_spec  # noqa: E402
from trainmem.models.hf import build_hf_model  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.trace.saved import saved_tensors  # noqa: E402
from trainmem.trace.torch_state import default_dtype  # noqa: E402

B, S = 2, 32
BART = dict(model_type="bart", d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=512,
            max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)


pytestmark = pytest.mark.usefixtures("traced_cache")  # one TRAINMEM_CACHE per session: tests/conftest.py


@pytest.mark.slow  # ~10 s each on two shared cores: a trace at seven (B, S) and a real forward
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_bart_traced_equals_autograd(tmp_path, precision, attention):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(BART))
    e = estimate(unmapped_model_spec(str(path)), StepSpec(batch=B, seq=S, precision=precision),
                 ImplSpec(profile="traced", device="cpu", attention=attention))
    torch.manual_seed(0)
    with default_dtype(torch.bfloat16 if precision == "bf16" else torch.float32):  # as trace_step builds it
        model = build_hf_model(BART, attention=attention)
    ids = torch.randint(3, BART["vocab_size"], (B, S))
    saved, loss = saved_tensors(model, lambda: model(ids, labels=ids).loss)
    # with the loss the caller holds (not saved): the traced profile's loss.value
    assert e.totals_bytes["activation"] == sum(s.nbytes for s in saved) + loss.untyped_storage().nbytes()
