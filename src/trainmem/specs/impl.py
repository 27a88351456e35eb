"""ImplSpec: which code's saved set is modelled, and which kernels and recompute it uses."""

from __future__ import annotations

from dataclasses import dataclass, fields

from trainmem.errors import SpecError
from trainmem import validate as v

__all__ = ["ImplSpec", "PROFILES", "ATTENTIONS", "RECOMPUTES", "DEVICES", "OPTIMIZER_IMPLS", "FLOAT8S",
           "COMPILE_SCOPES", "FRAMEWORKS", "RECOMPUTE_FROMS", "routing_hot_fraction", "every_k_counts"]

PROFILES = ("hf", "reference", "megatron", "traced")
ATTENTIONS = ("eager", "sdpa", "flash", "sdpa-math", "mem-efficient")
RECOMPUTES = ("none", "selective", "full", "every-k", "op")
RECOMPUTE_FROMS = ("kth", "first")  # every-k's first checkpointed block: k-1 (torchtitan, torchtune), 0 (transformers)
DEVICES = ("cuda", "cpu")
OPTIMIZER_IMPLS = ("auto", "foreach", "fused", "for-loop")
FLOAT8S = ("none", "tensorwise", "rowwise")
COMPILE_SCOPES = ("model", "block", "block-loss")
FRAMEWORKS = ("hf", "litgpt", "lit-gpt")  # whose modules run the block under the hf profile (estimate/rules_litgpt.py)
ATTENTION_ALIASES = {"memory-efficient": "mem-efficient", "efficient": "mem-efficient", "math": "sdpa-math"}


def routing_hot_fraction(routing: object) -> float:
    """The fraction of tokens that choose the same k experts: 0 for ``balanced``, 1 for ``worst``,
    F for ``skewed:F`` (0 <= F <= 1). Anything else is a SpecError naming the value."""
    if routing == "balanced":
        return 0.0
    if routing == "worst":
        return 1.0
    if isinstance(routing, str) and routing.startswith("skewed:"):
        try:
            fraction = float(routing[len("skewed:"):])
        except ValueError:
            fraction = float("nan")
        if 0.0 <= fraction <= 1.0:
            return fraction
        raise SpecError("routing", routing, "skewed:F needs a fraction F in [0, 1], e.g. skewed:0.5")
    raise SpecError("routing", routing, "must be balanced, worst or skewed:F with F in [0, 1]")


@dataclass(frozen=True, kw_only=True)
class ImplSpec:
    """How the model is implemented and run."""

    profile: str = "hf"
    """Whose saved set is modelled: ``hf`` (Hugging Face transformers modules), ``reference``
    (trainmem's own reference model), ``megatron`` (the accounting behind sbh(34 + 5as/h)) or
    ``traced`` (read off a fake-tensor trace of the transformers model, ``estimate/traced``)."""
    attention: str = "sdpa"
    """eager (materialized softmax), sdpa (PyTorch's dispatcher: flash on CUDA for 16-bit,
    efficient for fp32, the CPU flash kernel or math on CPU), flash, sdpa-math, mem-efficient."""
    recompute: str = "none"
    """none, selective (attention core), full (every block), every-k (every k-th block), op (every
    block under op-level selective checkpointing with torchtitan's policy: the outputs of the
    block's 1st, 3rd, 5th... mm, of addmm, bmm and the CUDA SDPA kernels are kept; hf profile only)."""
    recompute_every: int = 1
    """k for ``every-k``: every k-th block is checkpointed, which ones by ``recompute_from``."""
    recompute_from: str = "kth"
    """Which blocks ``every-k`` checkpoints: ``kth`` (blocks k-1, 2k-1, ...: torchtitan's and torchtune's
    1-based counter, the CLI's; none when k > L) or ``first`` (blocks 0, k, 2k, ...: transformers'
    ``every_n_layers``, read off a Trainer's arguments or a model's flags). Ignored by other recomputes."""
    recompute_counts: tuple[tuple[int, int], ...] = ()
    """Where ``every-k``'s counter stands under pipeline parallelism: ``(block, position)`` pairs, the block that
    opens a pipeline stage and how many of its rank's blocks the counter passed before it (torchtitan's counter is
    per process: a rank counts its own stages' blocks; :func:`every_k_counts`). A block counts on from the last
    pair at or before it; ``()`` counts the model's blocks from block 0 (one device). Ignored by other
    recomputes (as ``recompute_from``: the plain twin ``replace(impl, recompute="none")`` keeps it). Placed from a
    ParallelSpec by ``estimate/every_k_stages.py`` ``place_every_k`` and ``trace/recompute.py``
    ``place_every_k_trace``, each in its own numbering of a rank's blocks."""
    fused_norm: bool = False
    """Norm kernel saves only its input and statistics (reference profile)."""
    fused_bias_act: bool = False
    """Bias + activation fused: the pre-activation is recomputed (reference profile)."""
    fused_dropout: bool = False
    """Dropout masks as bits packed into bytes (reference profile)."""
    inplace_act: bool = False
    """Activation applied in place (ReLU-style; its input is not saved) (reference profile)."""
    device: str = "cuda"
    """The device whose kernels are modelled: cuda (default) or cpu (dropout keeps a mask in
    the activation dtype; SDPA runs the CPU flash kernel, or math with dropout)."""
    optimizer_impl: str = "auto"
    """How ``optimizer.step()`` runs: foreach (one kernel per op over every tensor: a
    parameter-sized temporary), fused (one kernel, no temporary), for-loop (tensor by tensor: the
    largest tensor's temporaries), or auto (torch's default on ``device``: foreach on cuda,
    for-loop on cpu)."""
    optimizer_in_backward: bool = False
    """Step each parameter in its post-accumulate-grad hook and free its gradient there
    (torchtune's ``optimizer_in_bwd``): gradients are never all alive. Needs grad_accum = 1."""

    routing: str = "balanced"
    """The MoE routing assumption (``routing_hot_fraction``): ``balanced`` (every expert gets its
    top-k share of the tokens), ``skewed:F`` (a fraction F of the tokens choose the same k
    experts, the rest are balanced) or ``worst`` (every token chooses the same k experts)."""
    compile: bool = False
    """The model runs under ``torch.compile``: what each region saves for backward is what
    inductor's min-cut partitioner keeps (``trainmem.trace.compiled``), not eager autograd's."""
    compile_scope: str = "model"
    """What ``compile`` compiles: ``model`` (one ``torch.compile(model)``, as the HF Trainer's
    ``torch_compile``), ``block`` (each decoder block compiled alone; the embedding, final norm,
    head and loss eager: torchtitan's ``apply_compile``) or ``block-loss`` (the blocks and, alone,
    the loss function: torchtune's ``compile_model`` and ``compile_loss``)."""
    float8: str = "none"
    """Float8 training as torchao's ``convert_to_float8_training`` does it (``estimate/float8.py``):
    ``none``, ``tensorwise`` or ``rowwise`` (``Float8LinearConfig.from_recipe_name``). Every
    ``nn.Linear`` whose two dims are multiples of 16 runs its matmuls in fp8, except the output head
    (torchtitan's configs: ``filter_fqns = ["output"]``); hf profile, eager."""
    float8_all_gather: bool = False
    """FSDP2 all-gathers the converted linears' weights in fp8 (torchao's
    ``enable_fsdp_float8_all_gather``, torchtitan's ``[float8] enable_fsdp_float8_all_gather``):
    1 byte per element gathered instead of the compute dtype. tensorwise only."""

    framework: str = "hf"
    """Whose decoder-block code runs under the ``hf`` profile: ``hf`` (transformers' modules) or
    ``litgpt`` (LitGPT's ``Block``/``CausalSelfAttention``/``RMSNorm`` and ``LoRAQKVLinear``,
    ``estimate/rules_litgpt.py``, ``rules_litgpt_variants.py``; Llama, GPT-NeoX and Gemma / Gemma-2
    blocks) or ``lit-gpt`` (its October 2023 ``lit_gpt``
    package, whose RMSNorm ran in the input's dtype)."""

    def __post_init__(self) -> None:
        v.one_of("profile", self.profile, PROFILES)
        v.one_of("framework", self.framework, FRAMEWORKS)
        if self.framework != "hf" and self.profile != "hf":
            raise SpecError("framework", self.framework, f"is modelled under profile='hf', not {self.profile!r}")
        object.__setattr__(self, "attention", ATTENTION_ALIASES.get(self.attention, self.attention))
        v.one_of("attention", self.attention, ATTENTIONS)
        v.one_of("recompute", self.recompute, RECOMPUTES)
        v.positive("recompute_every", self.recompute_every, maximum=10**6)
        v.one_of("recompute_from", self.recompute_from, RECOMPUTE_FROMS)
        if self.recompute != "every-k" and self.recompute_every != 1:
            raise SpecError("recompute_every", self.recompute_every, f"needs recompute='every-k', not {self.recompute!r}")
        self._check_counts()
        if self.recompute == "op" and self.profile not in ("hf", "traced"):
            raise SpecError("recompute", self.recompute, f"op-level checkpointing is modelled for profile='hf' "
                            f"(Hugging Face modules), not {self.profile!r}")
        for name in ("fused_norm", "fused_bias_act", "fused_dropout", "inplace_act"):
            v.boolean(name, getattr(self, name))
        v.one_of("device", self.device, DEVICES)
        v.one_of("optimizer_impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        v.boolean("optimizer_in_backward", self.optimizer_in_backward)
        routing_hot_fraction(self.routing)
        v.boolean("compile", self.compile)
        v.one_of("compile_scope", self.compile_scope, COMPILE_SCOPES)
        if self.compile_scope != "model" and not self.compile:
            raise SpecError("compile_scope", self.compile_scope, "needs compile=True (--compile)")
        self._check_float8()

    def _check_counts(self) -> None:
        counts = self.recompute_counts
        if not counts:
            return
        if not isinstance(counts, tuple) or not all(
                isinstance(c, tuple) and len(c) == 2 and all(type(x) is int and x >= 0 for x in c) for c in counts):
            raise SpecError("recompute_counts", counts, "must be (block, position) pairs of integers >= 0")
        blocks = [b for b, _ in counts]
        if blocks != sorted(set(blocks)):
            raise SpecError("recompute_counts", counts, "needs its blocks in increasing order, each once")

    def _check_float8(self) -> None:
        v.one_of("float8", self.float8, FLOAT8S)
        v.boolean("float8_all_gather", self.float8_all_gather)
        if self.float8_all_gather and self.float8 != "tensorwise":
            # torchao/float8/config.py, Float8LinearConfig.__post_init__: the fp8 all-gather needs tensorwise
            raise SpecError("float8_all_gather", self.float8_all_gather,
                            f"needs float8='tensorwise' (torchao's fp8 all-gather), not {self.float8!r}")
        if self.float8 == "none":
            return
        if self.profile != "hf":
            raise SpecError("float8", self.float8, f"is modelled for profile='hf' (Hugging Face modules), "
                            f"not {self.profile!r}")
        # compile: traced as is; estimate/rules_compiled.py check_compiled says which compiled steps are modelled

    def compile_words(self) -> str:
        """The headers' words for ``compile`` (empty without it), e.g. `` torch.compile per block (saved set: ...)``."""
        if not self.compile:
            return ""
        scope = {"model": "", "block": " per block", "block-loss": " per block and loss"}[self.compile_scope]
        return f" torch.compile{scope} (saved set: docs/compile.md)"

    def float8_words(self) -> str:
        """The headers' words for Float8 (empty without it), e.g. `` float8=tensorwise (fp8 all-gather)``."""
        if self.float8 == "none":
            return ""
        return f" float8={self.float8}" + (" (fp8 all-gather)" if self.float8_all_gather else "")

    def checkpointed(self, layer: int) -> bool:
        """Whether block ``layer`` runs under activation checkpointing (under ``op`` with a policy
        that keeps some op outputs)."""
        if self.recompute in ("full", "op"):
            return True
        if self.recompute == "every-k":
            # torchtitan distributed/activation_checkpoint.py _apply_layer_sac (earlier
            # models/llama3/parallelize_llama.py _apply_ac_to_transformer_block) and torchtune
            # training/activations.py checkpoint_wrapper: a counter incremented before the test
            # `count % ac_freq == 0`, so the k-th, 2k-th... wrapped block (0-based k-1, 2k-1, ...);
            # transformers modeling_utils.py PreTrainedModel._set_gradient_checkpointing tests
            # `layer_index % every_n_layers == 0` (0, k, 2k, ...)
            first = 0 if self.recompute_from == "first" else self.recompute_every - 1
            position = layer
            for block, start in self.recompute_counts:  # under pp: the rank's own count (recompute_counts)
                if block > layer:
                    break
                position = start + layer - block
            return position % self.recompute_every == first
        return False

    def counted_by_ranks(self, ranks: list[list[tuple[int, int]]], pp: int) -> ImplSpec:
        """This spec with ``every-k``'s count run over each pipeline rank's own blocks (:func:`every_k_counts`;
        ``ranks``: each rank's stages' ``[start, end)`` blocks in the order it builds them); itself for other
        recomputes and one stage. ``recompute_from='first'`` keeps the whole model's count (no ``recompute_counts``,
        in the model's numbering of the blocks): transformers' ``PreTrainedModel._set_gradient_checkpointing``
        (modeling_utils.py) counts the ``GradientCheckpointingLayer`` modules of the model
        ``activation_checkpointing_enable(every_n_layers=k)`` is called on, in ``self.modules()`` order, and sets each
        block's ``gradient_checkpointing`` flag: called on the whole model (the Trainer's, trace/step.py's), before the
        pipeline cut, whose stages keep their blocks and so their flags (blocks 0, k, 2k... of the model)."""
        from dataclasses import replace

        if self.recompute != "every-k" or pp == 1:
            return self
        if self.recompute_from == "first":
            return replace(self, recompute_counts=())
        return replace(self, recompute_counts=every_k_counts(ranks))

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def every_k_counts(ranks: list[list[tuple[int, int]]]) -> tuple[tuple[int, int], ...]:
    """``ImplSpec.recompute_counts`` for pipeline ranks, each given as its stages' ``[start, end)`` blocks in
    the order the rank builds them: torchtitan's ``_apply_layer_sac`` (distributed/activation_checkpoint.py)
    increments a module-level ``_layer_sac_count`` for every block ``apply_ac`` wraps, and ``apply_ac`` runs
    once per model part a rank holds (distributed/pipeline_parallel.py: ``pipeline_module_split``, then
    ``parallelize_fn`` on each of ``model_parts`` in order), so the count runs over a rank's own blocks, on across
    its virtual stages, and never over another rank's."""
    counts = []
    for stages in ranks:
        done = 0
        for start, end in stages:
            counts.append((start, done))
            done += end - start
    return tuple(sorted(counts))
