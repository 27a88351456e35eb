"""Per model family: which engine covers it and how close each engine is to the real thing.

Every family issue 14 lists (tests/trace/tiny_families.py) and every family with hand-written rules,
on a tiny config widened to hidden 256, 2 blocks, B=2, S=256, CPU, fp32 and bf16 (SDPA; eager where
transformers has no SDPA path). Per family and precision:

  - trace: ``trace_step`` on fake tensors, its step peak against the same step on real tensors
    (``trace_step(real=True)``);
  - hf: ``estimate --profile hf --device cpu`` activations (less the loss value the caller holds,
    ``estimate/loss_value.py``: autograd does not save it) against what autograd saves in a real
    forward (``trace/saved.py`` ``saved_tensors``, less the model's registered buffers: the buffer
    ledger's; MoE routing forced as the trace forces it,
    ``--routing balanced``), where the hand-written rules cover the family;
  - traced: the same for ``estimate --profile traced``.

Each cell is ``engine / real`` as a ratio (``1 (equal)`` when equal to the byte) or the one-line
refusal. The engine column names the first that covers the family: ``estimate (hf rules)``,
``estimate --profile traced``, ``trace``.

Writes bench/results/families.md (and .json).

    PYTHONPATH=src python bench/families.py [--families olmo2,qwen3_moe] [--precisions bf16] [--no-real]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "trace"))  # tiny_families: the configs the trace tests use

from tiny_families import FAMILIES  # noqa: E402

B, S = 2, 256
EAGER_ONLY = {"gpt_oss", "deberta-v2", "gemma2"}  # transformers 5.x gives them no SDPA path

#: families with hand-written hf rules (tiny configs; widened below like the rest)
_DENSE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
RULED = {
    "llama": dict(_DENSE), "qwen2": dict(_DENSE), "qwen3": dict(_DENSE, head_dim=16), "mistral": dict(_DENSE),
    "mixtral": dict(_DENSE, num_local_experts=4, num_experts_per_tok=2), "gemma": dict(_DENSE, head_dim=16),
    "gemma2": dict(_DENSE, head_dim=16), "phi3": dict(_DENSE, pad_token_id=0),  # Phi3Config pads with id 32000
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=512),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     vocab_size=512, max_position_embeddings=512),
    "bert": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 vocab_size=512, max_position_embeddings=512),
}
for _name, _cfg in RULED.items():
    _cfg["model_type"] = _name

#: size keys -> the widened value (hidden 256; per-head and expert widths scaled alike)
WIDEN = {"hidden_size": 256, "n_embd": 256, "d_model": 256, "intermediate_size": 512, "d_ff": 512,
         "intermediate_size_mlp": 512, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256,
         "head_dim": 64, "d_kv": 64, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
         "qk_nope_head_dim": 64, "v_head_dim": 64, "qk_rope_head_dim": 32, "kv_lora_rank": 64, "q_lora_rank": 128}
#: dropout keys set to 0: the real step and the trace must draw the same (no) masks
DROPOUT = ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop",
           "dropout_rate", "hidden_dropout", "attention_dropout", "classifier_dropout")


def widen(cfg: dict) -> dict:
    out = {k: WIDEN.get(k, v) for k, v in cfg.items()}
    if cfg["model_type"] == "falcon":
        out["hidden_size"] = 256
    if "qk_rope_head_dim" in cfg and "head_dim" in cfg:  # DeepSeek-V3's head_dim is its rope width
        out["head_dim"] = out["qk_rope_head_dim"]
    for k in DROPOUT:
        out[k] = 0.0
    return out


def configs() -> dict[str, dict]:
    return {name: widen(cfg) for name, cfg in {**RULED, **FAMILIES}.items()}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = re.sub(r"\S*/(\w[\w-]*)\.json", r"\1", text)  # the temporary file's path: its family name
    if "is not supported by the estimator's hf rules" in text:
        return "no hf rules for this model type"
    return f"{type(exc).__name__}: {text}"[:140].replace("|", "/")


def _ratio(got: int, real: int) -> str:
    return "1 (equal)" if got == real else f"{got / real:.4f} ({got - real:+,} B)"


def saved_bytes(cfg: dict, precision: str, attention: str) -> int:
    """What autograd saves for backward in a real CPU forward + loss, built as trace_step builds it."""
    import torch

    from trainmem.models.hf import build_hf_model
    from trainmem.specs.impl import routing_hot_fraction
    from trainmem.trace.routing import experts_modules, force_routing
    from trainmem.trace.saved import saved_tensors
    from trainmem.trace.torch_state import default_dtype

    torch.manual_seed(0)
    with default_dtype(torch.bfloat16 if precision == "bf16" else torch.float32):
        model = build_hf_model(cfg, attention=attention)
    ids = torch.randint(0, cfg["vocab_size"], (B, S))
    forced = force_routing(model, routing_hot_fraction("balanced")) if experts_modules(model) else None
    with forced or contextlib.nullcontext():
        # the model's own buffers autograd saves (position ids, Gemma's embed_scale, MiniMax's decay tables) are
        # the buffer ledger's bytes, not activations: left out on both sides (estimate/buffers.py)
        saved, _ = saved_tensors(model, lambda: model(input_ids=ids, labels=ids).loss, buffers=False)
    return sum(s.nbytes for s in saved)


def _estimate_activations(path: str, profile: str, precision: str, attention: str) -> int:
    from trainmem.estimate import estimate
    from trainmem.estimate.traced import unmapped_model_spec
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.loaders import load_model

    model = (unmapped_model_spec(path) if profile == "traced" else None) or load_model(path)
    impl = ImplSpec(profile=profile, device="cpu", attention=attention, routing="balanced")
    est = estimate(model, StepSpec(batch=B, seq=S, precision=precision), impl)
    # the loss value (estimate/loss_value.py) is an activation item the caller holds, not one autograd saves
    held = sum(i.bytes for i in est.inventory.items if i.name == "loss.value")
    return est.totals_bytes["activation"] - held


def measure(name: str, cfg: dict, precision: str, real: bool, tmp: Path) -> dict:
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.trace import trace_step

    attention = "eager" if cfg["model_type"] in EAGER_ONLY else "sdpa"
    row = {"family": name, "model_type": cfg["model_type"], "precision": precision, "attention": attention}
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    step, impl = StepSpec(batch=B, seq=S, precision=precision), ImplSpec(attention=attention, device="cpu")
    t0 = time.perf_counter()
    try:
        fake = trace_step(cfg, step, impl)
        row["trace_peak_bytes"] = fake.peak_bytes
        if real:
            row["real_peak_bytes"] = trace_step(cfg, step, impl, real=True).peak_bytes
            row["trace"] = _ratio(fake.peak_bytes, row["real_peak_bytes"])
    except Exception as exc:  # one line per family, whatever the failure
        row["trace"] = _one_line(exc)
    need_saved = real
    for profile in ("hf", "traced"):
        try:
            row[f"{profile}_activation_bytes"] = _estimate_activations(str(path), profile, precision, attention)
        except Exception as exc:
            row[profile] = _one_line(exc)
    if need_saved and any(f"{p}_activation_bytes" in row for p in ("hf", "traced")):
        try:
            row["autograd_saved_bytes"] = saved_bytes(cfg, precision, attention)
            for p in ("hf", "traced"):
                if f"{p}_activation_bytes" in row:
                    row[p] = _ratio(row[f"{p}_activation_bytes"], row["autograd_saved_bytes"])
        except Exception as exc:
            row["autograd"] = _one_line(exc)
    row["engine"] = ("estimate (hf rules)" if "hf_activation_bytes" in row else
                     "estimate --profile traced" if "traced_activation_bytes" in row else
                     "trace" if "trace_peak_bytes" in row else "none")
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def _cell(text: str) -> str:
    """A refusal as the table shows it: what is missing, without the family's name again."""
    text = re.sub(r"^UnsupportedError: [\w-]+: the hf profile has no hand-written rules for [\w-]+ blocks \((.*)\)(; .*)?$",
                  r"no hf rules for its layer kinds (\1)", text)
    return text.replace("UnsupportedError: --profile traced: ", "refused: ").replace("UnsupportedError: ", "refused: ")


def render(rows: list[dict]) -> str:
    lines = ["# Model families: engine and measured agreement", "",
             f"machine: {platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} CPUs (shared)",
             f"tiny configs widened to hidden 256, 2 blocks; B={B}, S={S}, CPU; SDPA (eager: "
             f"{', '.join(sorted(EAGER_ONLY))}); MoE routing balanced", "",
             "trace: fake-tensor step peak / real-tensor step peak. hf, traced: the estimate's activations, less "
             "the loss value the caller holds (4 B), / what autograd saves in a real forward, less the model's "
             "registered buffers (the buffer ledger). `1 (equal)`: to the "
             "byte.", "",
             "| family | engine | precision | trace / real peak | hf rules / autograd | traced / autograd |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [_cell(r.get(k, "not measured")) for k in ("trace", "hf", "traced")]
        lines.append(f"| {r['family']} | {r['engine']} | {r['precision']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--no-real", action="store_true", help="skip the real-tensor runs (engines only)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "families.md"))
    ap.add_argument("--update", action="store_true",
                    help="keep the rows of --out's .json and replace those measured again (family, precision)")
    args = ap.parse_args(argv)
    all_cfgs = configs()
    names = [n for n in args.families.split(",") if n] or list(all_cfgs)
    unknown = [n for n in names if n not in all_cfgs]
    if unknown:
        ap.error(f"--families: unknown {', '.join(unknown)} (known: {', '.join(all_cfgs)})")
    rows, kept = [], []
    old = Path(args.out).with_suffix(".json")
    if args.update and old.is_file():
        kept = json.loads(old.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TRAINMEM_CACHE", str(Path(tmp) / "cache"))
        for precision in args.precisions.split(","):  # one precision for every family first
            for name in names:
                row = measure(name, all_cfgs[name], precision, not args.no_real, Path(tmp))
                print(json.dumps(row), flush=True)
                rows.append(row)
                done = {(r["family"], r["precision"]) for r in rows}
                _write(Path(args.out), [r for r in kept if (r["family"], r["precision"]) not in done] + rows)
    return 0


def _write(out: Path, rows: list[dict]) -> None:
    order = {name: i for i, name in enumerate(configs())}
    rows = sorted(rows, key=lambda r: (r["precision"] != "bf16", order.get(r["family"], len(order))))
    out.write_text(render(rows))
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
