"""Options shared by every command that takes a model and a step, and their conversion to specs.

Help text comes from the spec dataclasses' field docstrings where it can.
"""

from __future__ import annotations

import argparse

from trainmem.errors import SpecError
from trainmem.specs import ImplSpec, ModelSpec, StepSpec
from trainmem.specs.impl import ATTENTIONS, PROFILES, RECOMPUTES
from trainmem.specs.step import OPTIMIZERS, PRECISIONS, LOSSES

__all__ = ["add_model_step_args", "specs_from_args", "step_impl_from_args", "DEFAULT_MODEL"]

DEFAULT_MODEL = "llama-3-8b"


def _int(field: str):
    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{field}={text!r}: must be an integer") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"--{field}={value}: must be positive")
        return value
    parse.__name__ = field
    return parse


def add_model_step_args(p: argparse.ArgumentParser) -> None:
    """--model, --batch, --seq, --grad-accum, --precision, --optimizer, --loss, --attention,
    --recompute, --recompute-every, --profile, --device."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"preset name or path to a Hugging Face config.json / model folder (default {DEFAULT_MODEL})")
    p.add_argument("--batch", type=_int("batch"), default=1, help="micro-batch size B (default 1)")
    p.add_argument("--seq", type=_int("seq"), default=4096, help="sequence length S (default 4096)")
    p.add_argument("--grad-accum", type=_int("grad-accum"), default=1, help="micro-batches per optimizer step")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16",
                   help="fp32 | bf16/fp16 (pure) | amp-* (autocast, fp32 states) | mixed-* (fp32 master)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--loss", choices=LOSSES, default="ce", help="ce (full fp32 logits), chunked-ce, fused-ce")
    p.add_argument("--attention", choices=ATTENTIONS + ("memory-efficient",), default="sdpa")
    p.add_argument("--recompute", choices=RECOMPUTES, default="none")
    p.add_argument("--recompute-every", type=_int("recompute-every"), default=None,
                   help="k for --recompute every-k")
    p.add_argument("--profile", choices=PROFILES, default="hf",
                   help="whose saved set is modelled: hf, reference, megatron")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="kernels modelled (default cuda)")


def specs_from_args(args: argparse.Namespace) -> tuple[ModelSpec, StepSpec, ImplSpec]:
    from trainmem.specs.loaders import load_model

    return (load_model(args.model), *step_impl_from_args(args))


def step_impl_from_args(args: argparse.Namespace) -> tuple[StepSpec, ImplSpec]:
    """The step and implementation specs alone (for commands that build the model themselves)."""
    step = StepSpec(batch=args.batch, seq=args.seq, grad_accum=args.grad_accum, precision=args.precision,
                    optimizer=args.optimizer, loss=args.loss)
    every = args.recompute_every
    if every is not None and args.recompute != "every-k":
        raise SpecError("recompute_every", every, f"needs --recompute every-k, not {args.recompute}")
    impl = ImplSpec(profile=args.profile, attention=args.attention, recompute=args.recompute,
                    recompute_every=every or 1, device=args.device)
    return step, impl
