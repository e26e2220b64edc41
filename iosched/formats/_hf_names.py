"""What the tensor names and ``config.json`` keys of a Hugging Face MoE checkpoint mean.

The tables here are what ``_safetensors_index`` reads a checkpoint by; each says where its
entries come from.  They were taken from the checkpoints transformers 5 ``save_pretrained``
writes for every config class of the installed transformers that states an expert count
(``tests/_hf_corpus.py`` builds them; ``tests/test_conformance_hf.py`` checks every layout,
and scans the installed config classes so that a spelling of k or E missing here fails a
test rather than a user).

A tensor name is read as ``<stack>.<layers>.<L>.[layer.<S>.]<rest>``: ``<stack>`` is the
model's prefix (``model.``, ``language_model.``, ``backbone.``, ``encoder.``, ``mtp.`` ...),
``<layers>`` the layer container (``layers``, or ``block`` in T5-style encoder-decoders, whose
layers hold numbered sub-layers), and ``<rest>`` one of

* a per-expert tensor ``[<block>.]experts.<E>.<suffix>`` (``<E>`` may be spelt ``expert_<E>``,
  as NLLB-MoE and SwitchTransformers do);
* a fused tensor ``[<block>.]experts.<name>`` holding every expert on its first axis, or
  ``<block>.input_linear.weight`` / ``<block>.output_linear.weight`` (GraniteMoe, JetMoe:
  "parallel experts" with no ``experts`` component);
* shared experts, routers and dense MLPs, which the index leaves out (and records);
* anything else (attention, norms), which is no concern of an expert index.

``<block>`` is the layer's MoE module: one of :data:`EXPERT_BLOCKS`, or nothing (experts
directly under the layer, as Mistral Large 4 writes them).  Experts under an attention
module (:data:`ATTENTION_BLOCKS`, JetMoe's mixture of attention heads) are no MLP experts;
experts under any other name are refused by name (recorded, so the "no expert tensors"
message says what was found), never guessed at.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

EXPERTS_PER_TOKEN_KEYS = (
    "num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "moe_top_k", "top_k_experts",
    "experts_per_token", "top_k",
)  # fmt: skip
"""Keys of ``config.json`` that name k, the experts routed per token, most specific first:
``num_experts_per_tok`` (most models), ``num_experts_per_token`` (Kimi-Linear, Bailing),
``moe_k`` (ERNIE 4.5), ``moe_topk`` (Aria, Hunyuan, LongCat; Hunyuan's may be a per-layer
list), ``moe_top_k`` (DBRX, under ``ffn_config``), ``top_k_experts`` (Gemma 4),
``experts_per_token`` (gpt-oss's original release); the installed transformers' config classes
are scanned for others by a test.  ``top_k`` comes last because it is also a generation
parameter; a value larger than the checkpoint's experts per layer is rejected by
``build_index``."""
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Keys of ``config.json`` that name E, the routed experts per MoE layer: ``num_experts``
(Qwen-MoE, OLMoE, Jamba ...), ``num_local_experts`` (Mixtral, Llama 4, gpt-oss, GraniteMoe),
``n_routed_experts`` (DeepSeek, GLM-4.5, Nemotron-H), ``moe_num_experts`` (Aria, ERNIE 4.5,
DBRX under ``ffn_config``).  When one is given every layer must hold exactly that many."""
NESTED_CONFIG_KEYS = ("text_config", "thinker_config", "language_config", "llm_config", "ffn_config")
"""Sub-objects of ``config.json`` that hold the language model's settings, searched (one level
below each other, ``thinker_config.text_config`` for Qwen3-Omni) after the top level:
multimodal configs nest the text model's under ``text_config``; DBRX keeps its MoE settings in
``ffn_config``.  Vision and audio configs are not searched: their experts are a tower's."""

EXPERT_BLOCKS = ("mlp", "block_sparse_moe", "feed_forward", "ffn", "mixer", "moe", "")
"""Names of a layer's MoE module: ``mlp`` (Qwen, DeepSeek, gpt-oss ...), ``block_sparse_moe``
(Mixtral, MiniMax, GraniteMoe), ``feed_forward`` (Jamba, Llama 4), ``ffn`` (DeepSeek-V4,
NLLB-MoE), ``mixer`` (Nemotron-H), ``moe``; empty for experts directly under the layer
(Mistral Large 4)."""
ATTENTION_BLOCKS = ("self_attention", "self_attn", "attention", "attn")
"""Modules whose experts are attention experts (JetMoe's mixture of attention heads)."""
TOWER_WORDS = ("vision", "visual", "audio", "image", "video", "talker", "speech", "vit")
"""A stack whose prefix holds one of these words is a vision or audio tower (or Qwen3-Omni's
speech "talker"); its experts are left out when a language model's experts exist."""

CANONICAL = {
    "gate_proj.weight": "gate_proj",
    "up_proj.weight": "up_proj",
    "down_proj.weight": "down_proj",
    # Mixtral, MiniMax, DeepSeek-V4, Mistral Large 4: w1 is the gate, w3 the up projection,
    # w2 the down projection.
    "w1.weight": "gate_proj",
    "w3.weight": "up_proj",
    "w2.weight": "down_proj",
    # Inkling 2 (fused, vLLM's spelling): w13 is gate+up, w2 the down projection.
    "w2_weight": "down_proj",
}
"""Per-expert suffix -> canonical role; other suffixes keep their own name (``fc1.weight``)."""

FUSED_BASES = frozenset({
    "gate_up_proj", "down_proj", "gate_proj", "up_proj", "fc1", "fc2", "w1", "w2", "w3", "wi", "wo",
    "input_linear", "output_linear", "w13",
})  # fmt: skip
"""Fused tensor names (less ``.weight``/``.bias``, ``_bias``, ``_blocks``, ``_scales``) that hold
one slice per expert: ``gate_up_proj``/``down_proj`` (+ ``_bias``) of transformers' fused
experts and gpt-oss (+ MXFP4 ``_blocks``/``_scales``), ``fc1``/``fc2`` (Aria),
``input_linear``/``output_linear`` (GraniteMoe, JetMoe), ``w13_weight``/``w2_weight`` (Inkling 2).
Step 3.7 writes its experts' ``gate_proj``/``up_proj``/``down_proj`` fused without an
``experts`` component (``moe.gate_proj.weight`` of shape ``[E, I, H]``): an MLP projection of
three dimensions is read as fused experts.  A tensor under ``experts.`` by any
other name (a router bias, a norm shared by the experts) belongs to no single expert."""
FUSED_SUFFIXES = ("_bias", "_blocks", "_scales", "_weight", ".weight", ".bias")

GATE_UP_NAMES = frozenset({"gate_up_proj", "input_linear.weight", "fc1.weight", "w13_weight"})
"""Fused tensors that hold each expert's gate and up projections (``fc1`` only for Aria, see
:data:`GATE_UP_FC1`), with their partner down projection (:data:`DOWN_OF`): the view may also
show their two parts as ``gate_proj``/``up_proj``."""
DOWN_OF = {"gate_up_proj": "down_proj", "input_linear.weight": "output_linear.weight", "fc1.weight": "fc2.weight",
           "w13_weight": "w2_weight"}
GATE_UP_FC1 = frozenset({"aria", "aria_text"})
"""Architectures whose fused ``fc1`` is gate+up (Aria's grouped GEMM); NLLB-MoE's per-expert
``fc1`` is a plain up projection."""
INTERLEAVED = frozenset({"gpt_oss", "inkling2", "inkling2_text", "inkling2_loop", "inkling2_loop_text"})
"""Architectures whose fused gate+up tensor interleaves gate and up along its 2I axis (gate at
even positions, up at odd): gpt-oss's ``gate_up_proj`` (``gate_up[..., ::2], gate_up[..., 1::2]``
in transformers' gpt-oss), Inkling 2's ``w13_weight`` (transformers' conversion mapping
de-interleaves it into halves on load, ``Interleave(dim=1)``)."""
HALVES = frozenset({
    "aria", "aria_text", "diffusion_gemma", "diffusion_gemma_text", "gemma4", "gemma4_text", "glm4v_moe",
    "glm4v_moe_text", "granitemoe", "granitemoe_swa", "granitemoeshared",
    "granitemoehybrid", "hy_v4", "hy_v4_vl", "hy_v4_vl_text", "inkling", "inkling_text", "jetmoe", "lara_mini",
    "llama4", "llama4_text", "minimax_m3_vl", "minimax_m3_vl_text", "mistral4", "muse_spark", "muse_spark_text",
    "openai_privacy_filter", "qwen3_vl_moe", "qwen3_vl_moe_text", "zaya",
})  # fmt: skip
"""Architectures whose fused gate+up tensor is gate then up, each half of the 2I axis
(transformers' ``gate, up = ....chunk(2, dim=-1)``): those whose checkpoints the corpus holds
fused, each checked through the model's own forward (``tests/test_conformance_hf.py``).  An
architecture in neither table keeps its fused tensor whole: a guessed split would hand an
engine the wrong weights."""


MAX_NAME_CHARS = 1024
"""A layer's tensor name longer than this (after the layer) is read only as a per-expert name
(whose pattern runs in linear time, so an absurd expert id is still refused by name); the
fused, router and dense patterns may backtrack, so a hostile header's megabyte-long names
would cost them quadratic time.  The longest real names are about 100 characters
(``model.language_model.layers.47.mlp.experts.127.gate_proj.weight_scale_inv``)."""


@dataclass(frozen=True)
class Parsed:
    """One tensor name read by :func:`parse`."""

    what: str
    """``expert`` (per-expert), ``fused`` (every expert on axis 0), a skipped kind
    (``shared_expert``, ``router``, ``dense``, ``attention_experts``, ``unsupported_block``,
    ``other``) or ``none`` (a layer's tensor of no concern)."""
    stack: str
    """The prefix before the layer container, e.g. ``model.``, ``encoder.``, ``mtp.``."""
    layer: str
    """The layer's digits."""
    block: str
    expert: str = ""
    """The expert's digits (per-expert tensors)."""
    suffix: str = ""
    """The tensor's name inside its expert (``gate_proj.weight``), or the fused name."""


_LAYER_RE = re.compile(r"((?:[A-Za-z0-9_]+\.)*?)(layers|block|blocks|h)\.([0-9]+)\.(?:layer\.[0-9]+\.)?(.+)")
_PER_EXPERT_RE = re.compile(r"(?:(.+?)\.)?experts\.(?:expert_)?([0-9]+)\.(.+)")
_FUSED_RE = re.compile(r"(?:(.+?)\.)?experts\.([A-Za-z_][A-Za-z0-9_.]*)")
_PARALLEL_RE = re.compile(r"(.+?)\.((?:input|output)_linear\.(?:weight|bias))")
_ROUTER_RE = re.compile(r"(?:^|.*\.)(?:gate|router|expert_bias|e_score_correction_bias)(?:\..*)?")
_DENSE_RE = re.compile(
    r"(?:.+\.)?(?:gate_proj|up_proj|down_proj|gate_up_proj|w1|w2|w3|fc1|fc2|wi|wo|wi_0|wi_1)\.(?:weight|bias)")


def fused_base(name: str) -> str:
    """``name`` less the suffixes of :data:`FUSED_SUFFIXES` (``gate_up_proj_bias`` -> ``gate_up_proj``)."""
    for suffix in FUSED_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def parse(name: str) -> Parsed | None:
    """What ``name`` is (module docstring): ``None`` outside any layer, ``what="none"`` for a
    layer's tensor of no concern (attention, norms)."""
    m = _LAYER_RE.fullmatch(name)
    if m is None:
        return None
    stack, layer, rest = m.group(1), m.group(3), m.group(4)
    if "shared_expert" in rest:
        return Parsed("shared_expert", stack, layer, "")
    e = _PER_EXPERT_RE.fullmatch(rest)
    if e is not None:
        block = e.group(1) or ""
        return Parsed(_block_kind(block, "expert"), stack, layer, block, e.group(2), e.group(3))
    if len(rest) > MAX_NAME_CHARS:  # the patterns below may backtrack; no real name is this long
        return Parsed("none", stack, layer, "")
    f = _FUSED_RE.fullmatch(rest)
    if f is not None:
        block, fused = f.group(1) or "", f.group(2)
        if fused_base(fused) in FUSED_BASES:
            return Parsed(_block_kind(block, "fused"), stack, layer, block, suffix=fused)
        kind = "attention_experts" if block in ATTENTION_BLOCKS else (
            "router" if _ROUTER_RE.fullmatch(fused) or "bias" in fused else "other")
        return Parsed(kind, stack, layer, block, suffix=fused)
    p = _PARALLEL_RE.fullmatch(rest)
    if p is not None and (p.group(1) in EXPERT_BLOCKS or p.group(1) in ATTENTION_BLOCKS):
        return Parsed(_block_kind(p.group(1), "fused"), stack, layer, p.group(1), suffix=p.group(2))
    first = rest.split(".", 1)[0]
    if first in EXPERT_BLOCKS and _ROUTER_RE.fullmatch(rest):
        return Parsed("router", stack, layer, first)
    if first in EXPERT_BLOCKS and _DENSE_RE.fullmatch(rest):
        return Parsed("dense", stack, layer, first, suffix=rest[len(first) + 1:])
    return Parsed("none", stack, layer, "")


def _block_kind(block: str, kind: str) -> str:
    if block in EXPERT_BLOCKS:
        return kind
    if block in ATTENTION_BLOCKS:
        return "attention_experts"
    return "unsupported_block"


@functools.lru_cache(maxsize=1024)
def stack_kind(stack: str) -> str:
    """``mtp``, ``tower`` or ``language`` for a stack prefix (:data:`TOWER_WORDS`); cached, as a
    checkpoint has a few stacks and tens of thousands of tensors."""
    parts = [p for p in stack.lower().split(".") if p]
    if any(p == "mtp" or p.startswith("mtp_") for p in parts):
        return "mtp"
    if any(w in p for p in parts for w in TOWER_WORDS if w != "vit") or any(
            p == "vit" or p.startswith("vit_") for p in parts):
        return "tower"
    return "language"


def split_convention(architectures: tuple[str, ...], name: str) -> str:
    """``interleaved``, ``halves`` or ``""`` (unknown: no derived views) for the fused gate+up
    tensor ``name`` of a checkpoint of ``architectures`` (``config.json`` ``model_type``s, the
    top level's and the text config's)."""
    if name not in GATE_UP_NAMES:
        return ""
    if name == "fc1.weight" and not any(a in GATE_UP_FC1 for a in architectures):
        return ""
    if any(a in INTERLEAVED for a in architectures):
        return "interleaved"
    if any(a in HALVES for a in architectures):
        return "halves"
    return ""
