"""A refactor that must move no number: ``estimate()`` over a broad corpus, one JSON line per case (the sha-256 of
``Estimate.to_dict()``, or the refusal), run on two trees and compared.

Cases: every preset (S512 B1) and tiny configs of the families (tests/estimate/kinds_configs.py and the tracer tests'
layouts; S32 B1, S64 B2, S128 B2 under selective) x recompute none/full/selective/op/every-k x fp32/bf16/amp-bf16 x
LoRA or not, on CPU (sdpa, sdpa-math, eager) and CUDA (sdpa); tiny configs and four presets under DP+ZeRO-3, TP+SP,
PP, FSDP2, CP and ZeRO-1. 4,716 cases.

    git archive HEAD | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base/src .venv/bin/python bench/estimate_corpus.py /tmp/base.jsonl
    .venv/bin/python bench/estimate_corpus.py /tmp/after.jsonl
    .venv/bin/python bench/estimate_corpus.py --compare /tmp/base.jsonl /tmp/after.jsonl
"""
import hashlib
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "estimate"))
from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec, ParallelSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import list_presets, load_model, spec_from_hf_config
from kinds_configs import CONFIGS

TINY = {
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=256),
    "gpt2_nodrop": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=256,
                        attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0),
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256),
    "neox": dict(model_type="gpt_neox", hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, vocab_size=128, max_position_embeddings=512),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256),
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256,
                    num_local_experts=4, num_experts_per_tok=2),
    "mistral_win": dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=500, sliding_window=16,
                        max_position_embeddings=256),
    "phi3": dict(model_type="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, vocab_size=500, max_position_embeddings=256,
                 attention_dropout=0.1),
    "bert": dict(model_type="bert", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, vocab_size=500, max_position_embeddings=256),
    **CONFIGS,
}

def models():
    for n, c in TINY.items():
        yield "tiny:" + n, lambda c=c: spec_from_hf_config(c, name="t"), True
    for p in list_presets():
        yield "preset:" + p, lambda p=p: load_model(p), False

RECOMPUTES = [("none", 1), ("full", 1), ("selective", 1), ("op", 1), ("every-k", 2)]
PRECISIONS = ["fp32", "bf16", "amp-bf16"]

def cases():
    for (mname, mk, tiny), (rc, k), prec, lora in itertools.product(
            models(), RECOMPUTES, PRECISIONS, [False, True]):
        seq_b = [(64, 2), (128, 2), (32, 1)] if tiny else [(512, 1)]
        devs = [("cpu", "sdpa"), ("cpu", "sdpa-math"), ("cuda", "sdpa"), ("cpu", "eager")] if tiny else [("cpu", "sdpa"), ("cuda", "sdpa"), ("cpu", "eager"), ("cpu", "sdpa-math")]
        if rc != "selective":
            seq_b, devs = seq_b[:1], devs[:1] + devs[2:3]
        for (seq, b), (dev, att) in itertools.product(seq_b, devs):
            yield (mname, mk, rc, k, prec, lora, seq, b, dev, att, None)
    # parallel layouts
    for (mname, mk, tiny) in models():
        if not tiny and mname not in ("preset:gpt2", "preset:llama-3-8b", "preset:mixtral-8x7b", "preset:qwen3-8b"):
            continue
        for par, rc, prec in itertools.product(
                [dict(dp=2, zero=3), dict(tp=2, sp=True), dict(pp=2, microbatches=4), dict(dp=2, fsdp="full"),
                 dict(cp=2), dict(dp=2, zero=1)],
                ["none", "full", "selective"], ["bf16", "amp-bf16"]):
            yield (mname, mk, rc, 1, prec, False, 64 if tiny else 512, 2, "cpu", "sdpa", par)

def compare(base: str, after: str) -> int:
    a, b = ([json.loads(line) for line in open(p)] for p in (base, after))
    if [x["key"] for x in a] != [y["key"] for y in b]:
        print("the two runs hold different cases")
        return 2
    moved = [(x, y) for x, y in zip(a, b) if (x.get("sha"), x.get("err")) != (y.get("sha"), y.get("err"))]
    for x, y in moved:
        print("moved:", x["key"], x.get("peak", x.get("err")), "->", y.get("peak", y.get("err")))
    refused = sum("err" in x for x in a)
    print(f"{len(a)} cases: {len(a) - len(moved)} identical ({len(a) - refused - len(moved)} estimates, "
          f"{refused} refusals), {len(moved)} moved")
    return 1 if moved else 0


def main():
    if sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    out, shard, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0, int(sys.argv[3]) if len(sys.argv) > 3 else 1
    ms = {}
    with open(out, "w") as f:
        for idx, c in enumerate(cases()):
            if idx % n != shard:
                continue
            mname, mk, rc, k, prec, lora, seq, b, dev, att, par = c
            key = f"{mname}|{rc}{k}|{prec}|lora={lora}|S{seq}B{b}|{dev}|{att}|{par}"
            t0 = time.time()
            try:
                m = ms.get(mname) or ms.setdefault(mname, mk())
                step = StepSpec(batch=b, seq=seq, precision=prec, optimizer="adamw")
                impl = ImplSpec(attention=att, device=dev, recompute=rc, recompute_every=k)
                pspec = ParallelSpec(**par) if par else None
                e = estimate(m, step, impl, pspec, finetune=FinetuneSpec(mode="lora", lora_rank=8) if lora else None)
                s = json.dumps(e.to_dict(), sort_keys=True)
                res = dict(key=key, sha=hashlib.sha256(s.encode()).hexdigest(), peak=e.peak_bytes)
            except Exception as ex:
                res = dict(key=key, err=f"{type(ex).__name__}: {ex}"[:300])
            res["t"] = round(time.time() - t0, 2)
            f.write(json.dumps(res) + "\n"); f.flush()

if __name__ == "__main__":
    main()
