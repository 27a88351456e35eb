"""`trainmem trace` on every family issue 14 lists, whatever the estimator knows (tiny configs).

The full parametrization takes about two minutes on two CPU cores: it is marked slow. One family
of each kind (dense decoder, MoE, encoder with data-reading init, encoder-decoder) runs by default.
"""

import json

import pytest

from tiny_families import FAMILIES
from trainmem.cli import main
from trainmem.errors import SpecError, UnsupportedError
from trainmem.models.hf import choose_head
from trainmem.specs import ImplSpec, StepSpec
from trainmem.trace import trace_step

#: families transformers 5.x gives no SDPA path: they are traced with eager attention
EAGER_ONLY = {"gpt_oss", "deberta-v2"}
FAST = ("olmo2", "qwen3_moe", "modernbert", "t5")
HEAD_OF = {"roberta": "mlm", "modernbert": "mlm", "deberta-v2": "mlm", "t5": "seq2seq"}
CLASS_SUFFIX = {"lm": "ForCausalLM", "mlm": "ForMaskedLM", "seq2seq": "ForConditionalGeneration"}


def _trace_cli(tmp_path, capsys, config, *extra):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    attention = "eager" if config["model_type"] in EAGER_ONLY else "sdpa"
    rc = main(["trace", "--model", str(path), "--batch", "2", "--seq", "64", "--precision", "fp32",
               "--attention", attention, "--json", "--progress", "never", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f in FAST else pytest.mark.slow) for f in FAMILIES])
def test_trace_runs_every_family(family, tmp_path, capsys):
    d = _trace_cli(tmp_path, capsys, FAMILIES[family])
    head = HEAD_OF.get(family, "lm")
    assert d["meta"]["head"] == head
    assert d["meta"]["model_class"].endswith(CLASS_SUFFIX[head])
    assert d["meta"]["fake"] is True
    # every parameter was trained: it has a gradient and AdamW's two moments, each its own size
    items = {(i["category"], i["name"]): i["bytes"] for i in d["items"]}
    grads = {name.removesuffix(".grad") for cat, name in items if cat == "gradient"}
    params = {name: b for (cat, name), b in items.items() if cat == "parameter" and name in grads}
    assert params and all(items[("optimizer_state", f"{n}.exp_avg")] == b for n, b in params.items())
    assert all(items[("optimizer_state", f"{n}.exp_avg_sq")] == b for n, b in params.items())
    assert d["totals_at_peak_bytes"]["activation"] > 0


def test_heads_follow_architectures_then_the_model_type():
    assert choose_head({"model_type": "llama"}) == "lm"
    assert choose_head({"model_type": "roberta"}) == "mlm"
    assert choose_head({"model_type": "roberta", "is_decoder": True}) == "lm"
    assert choose_head({"model_type": "t5"}) == "seq2seq"
    assert choose_head({"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"]}) == "seq-cls"
    assert choose_head({"model_type": "llama"}, "seq-cls") == "seq-cls"
    with pytest.raises(UnsupportedError, match="no mlm head"):
        choose_head({"model_type": "llama"}, "mlm")
    with pytest.raises(SpecError, match="head"):
        choose_head({"model_type": "llama"}, "vision")


def test_sequence_classification_head_takes_one_label_per_sequence():
    cfg = dict(FAMILIES["olmo2"], num_labels=3)
    r = trace_step(cfg, StepSpec(batch=2, seq=64, precision="fp32"), ImplSpec(), head="seq-cls")
    assert r.meta["head"] == "seq-cls" and r.meta["model"] == "Olmo2ForSequenceClassification"
    labels = [i for i in r.items if i.name == "input.1"]
    assert [i.shape for i in labels] == [(2,)] and labels[0].bytes == 2 * 8  # B int64 class ids


def test_a_model_without_the_requested_kernel_says_why_in_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(FAMILIES["deberta-v2"]))
    assert main(["trace", "--model", str(path), "--seq", "64", "--attention", "sdpa"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["UnsupportedError: deberta-v2 has no sdpa attention in transformers; trace it with --attention eager"]


def test_learned_positions_bound_the_sequence_on_fake_tensors(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(FAMILIES["roberta"]))
    assert main(["trace", "--model", str(path), "--seq", "1024"]) == 2
    assert "roberta.embeddings.position_embeddings has 514 rows" in capsys.readouterr().err


def test_unknown_model_type_and_remote_code_are_refused():
    with pytest.raises(UnsupportedError, match="never runs remote code"):
        trace_step({"model_type": "acme_llm", "auto_map": {"AutoModelForCausalLM": "acme.Model"}, "hidden_size": 8})
    with pytest.raises(SpecError, match="hidden_size"):
        trace_step(dict(FAMILIES["olmo2"], hidden_size=-64))
