"""Tiny random-init causal LMs of every transformers family whose decoder mixes tokens along the
sequence with something other than attention (Gated DeltaNet, short convolutions, Mamba-1/2,
lightning and Kimi delta attention, RG-LRU, RWKV, mLSTM, n-gram embeddings, KV compressors).

``FAMILIES`` maps a transformers model_type to a ``Family``: the causal-LM and config classes
and the tiny config (hidden 32, vocab 128, 2-4 layers with at least one token-mixing
non-attention layer and, where the family has attention, one attention layer; small heads,
use_cache=False, no dropout, few experts) with each layer's kind as the config reports it
(``Family.kinds``, from ``config.layer_types`` or ``Family.kinds_attribute``) and the mixer classes.
``make_hybrid_model(family)`` builds it in float32, training mode, the same weights for the same
seed; ``layer_kinds(model)`` reads the kinds back from a built model's config.

transformers is imported only inside the functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import torch

VOCAB = 128
HIDDEN = 32

__all__ = ["VOCAB", "HIDDEN", "Family", "FAMILIES", "make_hybrid_model", "make_config", "layer_kinds"]


@dataclass(frozen=True)
class Family:
    """How to build one family's tiny causal LM from its config class."""

    model_class: str  # the transformers causal-LM class
    config_class: str  # the config class it is built from (the text config for multimodal families)
    config: Mapping[str, Any]  # the tiny config's keyword arguments
    kinds: tuple[str, ...]  # each layer's kind in the tiny model, as ``kinds_attribute`` reports it
    kinds_attribute: str = "layer_types"  # the (text) config attribute naming each layer's kind
    moe: bool = False  # built with experts_implementation="eager" (grouped_mm has no float64)
    mixers: tuple[str, ...] = ()  # the classes that mix tokens other than by attention
    notes: str = ""


_TOKENS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_COMMON = dict(_TOKENS, hidden_size=HIDDEN, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)
_HEADS = dict(num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)  # head dim 32 / 4 = 8
_ATTENTION = dict(_HEADS, head_dim=8)
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4)
_QWEN_MOE = dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4,
               mamba_expand=2, mamba_chunk_size=8)  # chunk 8 < a rank's 16 tokens: several SSD chunks
_KDA_MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
                num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=16, num_expert_group=1,
                topk_group=1)
_KDA_GLM = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=8, v_head_dim=8,
                linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4, n_routed_experts=4,
                num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16, n_group=1, topk_group=1)
_LINEAR_FULL = ("linear_attention", "full_attention")
_INKLING2 = dict(**_COMMON, **_ATTENTION, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
                 sliding_window_size=8, d_rel=4, rel_extent=16, conv_kernel_size=4, moe_intermediate_size=16,
                 n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=2, unpadded_vocab_size=VOCAB,
                 layer_types=["hybrid_sliding", "hybrid"])


def _family(model_class: str, config_class: str, kinds: tuple[str, ...], kinds_attribute: str = "layer_types",
            moe: bool = False, mixers: tuple[str, ...] = (), notes: str = "", **config: Any) -> Family:
    return Family(model_class, config_class, MappingProxyType(config), kinds, kinds_attribute, moe, mixers, notes)


FAMILIES: Mapping[str, Family] = MappingProxyType({
    # ---- Gated DeltaNet (its short causal conv on q/k/v included)
    "qwen3_5": _family(
        "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", _LINEAR_FULL, mixers=("Qwen3_5GatedDeltaNet",),
        **_COMMON, **_ATTENTION, **_GDN, intermediate_size=64, num_hidden_layers=2, layer_types=list(_LINEAR_FULL)),
    "qwen3_5_moe": _family(
        "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", _LINEAR_FULL, moe=True,
        mixers=("Qwen3_5MoeGatedDeltaNet",),
        **_COMMON, **_ATTENTION, **_GDN, **_QWEN_MOE, num_hidden_layers=2, layer_types=list(_LINEAR_FULL)),
    "qwen3_next": _family(
        "Qwen3NextForCausalLM", "Qwen3NextConfig", _LINEAR_FULL, moe=True, mixers=("Qwen3NextGatedDeltaNet",),
        **_COMMON, **_ATTENTION, **_GDN, **_QWEN_MOE, intermediate_size=64, num_hidden_layers=2,
        decoder_sparse_step=1, mlp_only_layers=[], layer_types=list(_LINEAR_FULL)),
    "olmo_hybrid": _family(
        "OlmoHybridForCausalLM", "OlmoHybridConfig", _LINEAR_FULL, mixers=("OlmoHybridGatedDeltaNet",),
        **_COMMON, **dict(_ATTENTION, num_key_value_heads=4), intermediate_size=64, num_hidden_layers=2,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=list(_LINEAR_FULL)),
    "lara_mini": _family(
        "LaraMiniForCausalLM", "LaraMiniConfig", ("linear_attention", "sliding_attention", "full_attention"),
        moe=True, mixers=("LaraMiniGatedDeltaNet",),
        **_COMMON, **_ATTENTION, **_GDN, **_QWEN_MOE, num_hidden_layers=3, sliding_window=8,
        layer_types=["linear_attention", "sliding_attention", "full_attention"]),
    "qwen4_exp": _family(
        "Qwen4ExpForCausalLM", "Qwen4ExpTextConfig", ("linear_attention", "indexed_attention"), moe=True,
        mixers=("Qwen4ExpTextGatedDeltaNet", "Qwen4ExpTextPLELayer", "Qwen4ExpTextNGramEmbedding",
                "Qwen4ExpTextQSAIndexer"),
        notes="layer 0 adds a PLE: n-gram embeddings of the token ids and a dilated conv (zero-initialised); the "
              "indexed layer's QSA indexer reads the materialised 4D mask (attn_implementation eager or sdpa)",
        **_COMMON, **_ATTENTION, **_GDN, **_QWEN_MOE, num_hidden_layers=2,
        layer_types=["linear_attention", "indexed_attention"], hc_count=2, hc_lowrank=8, ple_layer_ids=[1],
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4,
        ple_embed_dim=16, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=256,
        make_ngram_vocab_size_divisible_by=8, split_ngram_parts=2),
    # ---- Kimi delta attention (per-channel decay; its short convs on q/k/v included)
    "kimi_linear": _family(
        "KimiLinearForCausalLM", "KimiLinearConfig", _LINEAR_FULL, moe=True, mixers=("KimiLinearDeltaAttention",),
        **_COMMON, **dict(_ATTENTION, num_key_value_heads=4), **_KDA_MLA, intermediate_size=64,
        num_hidden_layers=2, layer_types=list(_LINEAR_FULL), mlp_layer_types=["dense", "sparse"]),
    "bailing_hybrid": _family(
        "BailingHybridForCausalLM", "BailingHybridConfig", _LINEAR_FULL, moe=True,
        mixers=("BailingHybridDeltaAttention",),
        **_COMMON, **dict(_ATTENTION, num_key_value_heads=4), **_KDA_MLA, intermediate_size=64,
        num_hidden_layers=2, first_k_dense_replace=1, layer_group_size=2, num_nextn_predict_layers=0,
        layer_types=list(_LINEAR_FULL), mlp_layer_types=["dense", "sparse"]),
    "glm5_next": _family(
        "Glm5NextForConditionalGeneration", "Glm5NextConfig", ("linear_attention", "indexed_attention"), moe=True,
        mixers=("Glm5NextTextLinearAttention", "Glm5NextTextIndexer"),
        notes="no text-only causal LM: the image-text model (a tiny vision tower) fed text only; the indexed "
              "layer passes its top-k selection to attention as a mask tensor",
        text_config=dict(**_COMMON, **dict(_HEADS, num_key_value_heads=4), **_KDA_GLM, intermediate_size=64,
                         num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"],
                         mlp_layer_types=["dense", "sparse"], indexer_types=["full", "full"], index_topk=8,
                         index_head_dim=8, index_n_heads=2, index_kpool=4, hc_mult=2, hc_sinkhorn_iters=3),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=HIDDEN,
                           projection_intermediate_size=16, patch_size=4, image_size=16),
        pad_token_id=0, tie_word_embeddings=False),
    # ---- lightning attention (linear attention, a fixed decay per head)
    "minimax": _family(
        "MiniMaxForCausalLM", "MiniMaxConfig", _LINEAR_FULL, moe=True, mixers=("MiniMaxLightningAttention",),
        **_COMMON, **_ATTENTION, intermediate_size=64, num_hidden_layers=2, num_local_experts=4,
        num_experts_per_tok=2, block_size=8, layer_types=list(_LINEAR_FULL)),
    # ---- short causal convolutions
    "lfm2": _family(
        "Lfm2ForCausalLM", "Lfm2Config", ("conv", "full_attention"), mixers=("Lfm2ShortConv",),
        **_COMMON, **_HEADS, intermediate_size=64, num_hidden_layers=2, block_auto_adjust_ff_dim=False,
        layer_types=["conv", "full_attention"]),
    "lfm2_moe": _family(
        "Lfm2MoeForCausalLM", "Lfm2MoeConfig", ("conv", "full_attention", "conv"), moe=True,
        mixers=("Lfm2MoeShortConv",),
        **_COMMON, **_HEADS, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_dense_layers=1, num_experts=4, num_experts_per_tok=2, layer_types=["conv", "full_attention", "conv"]),
    "lfm3": _family(
        "Lfm3ForCausalLM", "Lfm3Config", ("conv", "full_attention", "sliding_attention"), mixers=("Lfm3ShortConv",),
        **_COMMON, **_ATTENTION, intermediate_size=64, num_hidden_layers=3, sliding_window=8,
        layer_types=["conv", "full_attention", "sliding_attention"]),
    "inkling": _family(
        "InklingForCausalLM", "InklingTextConfig", ("hybrid_sliding", "hybrid"), moe=True,
        mixers=("InklingShortConvolution",),
        notes="every layer: attention (short convs on k and v, a content-dependent relative position_bias) "
              "and short convs after the attention and after the MLP",
        **_COMMON, **_ATTENTION, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
        sliding_window_size=8, d_rel=4, rel_extent=16, conv_kernel_size=4, intermediate_size=64,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        num_hidden_layers=2, layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "sparse"],
        unpadded_vocab_size=VOCAB),
    "inkling2": _family(
        "Inkling2ForCausalLM", "Inkling2TextConfig", ("hybrid_sliding", "hybrid"), moe=True,
        mixers=("Inkling2ShortConvolution", "Inkling2DynamicShortConvolution"),
        notes="as inkling; the full layers' k/v convs have per-token taps; block attention residuals attend "
              "over depth through the attention interface",
        **_INKLING2, num_hidden_layers=2),
    "inkling2_loop": _family(
        "Inkling2LoopForCausalLM", "Inkling2LoopTextConfig", ("hybrid_sliding", "hybrid") * 2, moe=True,
        mixers=("Inkling2LoopShortConvolution", "Inkling2LoopDynamicShortConvolution"),
        notes="as inkling2; layers 2-3 run twice (a loop)",
        **dict(_INKLING2, layer_types=["hybrid_sliding", "hybrid"] * 2), num_hidden_layers=4,
        loop_layer_index_start=2, loop_layer_index_end=4, loop_num_passes=2, loop_gate_rank=4),
    "zaya": _family(
        "ZayaForCausalLM", "ZayaConfig", ("hybrid", "hybrid"), moe=True, mixers=("ZayaCCAProjection",),
        notes="attention whose q/k come from two stacked causal convs and whose v is half the previous token's",
        **_COMMON, **_ATTENTION, num_hidden_layers=2, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=1, router_hidden_size=16, layer_types=["hybrid", "hybrid"]),
    # ---- Mamba-2 (SSD; its short causal conv on x/B/C included)
    "bamba": _family(
        "BambaForCausalLM", "BambaConfig", _LINEAR_FULL, mixers=("BambaMixer",),
        **_COMMON, **_HEADS, **_MAMBA2, intermediate_size=64, num_hidden_layers=2, attn_layer_indices=[1]),
    "granitemoehybrid": _family(
        "GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", _LINEAR_FULL, moe=True,
        mixers=("GraniteMoeHybridMambaLayer",),
        **_COMMON, **_HEADS, **_MAMBA2, intermediate_size=64, num_hidden_layers=2, num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=16, layer_types=list(_LINEAR_FULL)),
    "nemotron_h": _family(
        "NemotronHForCausalLM", "NemotronHConfig", ("linear_attention", "full_attention", "mlp", "moe"), moe=True,
        mixers=("NemotronHMamba2Mixer",),
        **_COMMON, **_ATTENTION, num_hidden_layers=4, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=16,
        n_groups=1, ssm_state_size=8, conv_kernel=4, expand=2, chunk_size=8, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
        layers_block_type=["linear_attention", "full_attention", "mlp", "moe"]),
    "zamba2": _family(
        "Zamba2ForCausalLM", "Zamba2Config", ("linear_attention", "hybrid"), mixers=("Zamba2MambaMixer",),
        notes="a hybrid layer: the shared attention block, then a Mamba-2 layer",
        **_COMMON, num_attention_heads=4, num_key_value_heads=4, attention_dropout=0.0, intermediate_size=64,
        num_hidden_layers=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, n_mamba_heads=4,
        chunk_size=8, adapter_rank=4, layers_block_type=["linear_attention", "hybrid"]),
    "falcon_h1": _family(
        "FalconH1ForCausalLM", "FalconH1Config", ("hybrid", "hybrid"), mixers=("FalconH1Mixer",),
        notes="every layer runs attention and a Mamba-2 mixer side by side",
        **_COMMON, **_ATTENTION, **dict(_MAMBA2, mamba_d_ssm=64), intermediate_size=64, num_hidden_layers=2),
    "mamba2": _family(
        "Mamba2ForCausalLM", "Mamba2Config", ("linear_attention",) * 2, mixers=("Mamba2Mixer",),
        notes="attention-free",
        **_TOKENS, hidden_size=HIDDEN, num_hidden_layers=2, num_heads=4, head_dim=16, n_groups=1, state_size=8,
        conv_kernel=4, expand=2, chunk_size=8, use_cache=False, tie_word_embeddings=False),
    # ---- Mamba-1 (selective scan; its short causal conv included)
    "jamba": _family(
        "JambaForCausalLM", "JambaConfig", _LINEAR_FULL, moe=True, mixers=("JambaMambaMixer",),
        notes="the decoder reads config.layers_block_type ('mamba' / 'attention')",
        **_COMMON, **_HEADS, intermediate_size=64, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4),
    "zamba": _family(
        "ZambaForCausalLM", "ZambaConfig", ("linear_attention", "hybrid"), mixers=("ZambaMambaMixer",),
        notes="a hybrid layer: the shared attention block, then a Mamba-1 layer",
        **_COMMON, num_attention_heads=4, num_key_value_heads=4, attention_dropout=0.0, intermediate_size=64,
        num_hidden_layers=2, n_mamba_heads=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        layers_block_type=["linear_attention", "hybrid"]),
    "mamba": _family(
        "MambaForCausalLM", "MambaConfig", ("linear_attention",) * 2, mixers=("MambaMixer",),
        notes="attention-free",
        **_TOKENS, hidden_size=HIDDEN, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2,
        time_step_rank=4, use_cache=False, tie_word_embeddings=False),
    "falcon_mamba": _family(
        "FalconMambaForCausalLM", "FalconMambaConfig", ("linear_attention",) * 2, mixers=("FalconMambaMixer",),
        notes="attention-free (Mamba-1 with RMS-normed B, C and dt)",
        **_TOKENS, hidden_size=HIDDEN, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2,
        time_step_rank=4, use_cache=False, tie_word_embeddings=False),
    # ---- other recurrences
    "recurrent_gemma": _family(
        "RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", ("linear_attention", "sliding_attention"),
        mixers=("RecurrentGemmaRecurrentBlock", "RecurrentGemmaRglru"),
        notes="the decoder reads config.layers_block_type (from block_types 'recurrent' / 'attention')",
        **_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_dropout=0.0,
        intermediate_size=64, num_hidden_layers=2, lru_width=HIDDEN, attention_window_size=16, conv1d_width=4,
        block_types=["recurrent", "attention"]),
    "rwkv": _family(
        "RwkvForCausalLM", "RwkvConfig", ("RwkvSelfAttention",) * 2, kinds_attribute="",
        mixers=("RwkvSelfAttention", "RwkvFeedForward"),
        notes="attention-free: RWKV-4 time mixing; both it and the channel-mixing MLP shift tokens by one",
        **_TOKENS, hidden_size=HIDDEN, attention_hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
        context_length=64, use_cache=False, tie_word_embeddings=False),
    "xlstm": _family(
        "xLSTMForCausalLM", "xLSTMConfig", ("xLSTMLayer",) * 2, kinds_attribute="", mixers=("xLSTMLayer",),
        notes="attention-free: every block an mLSTM layer",
        **_TOKENS, hidden_size=HIDDEN, embedding_dim=HIDDEN, num_hidden_layers=2, num_blocks=2, num_heads=2,
        chunk_size=8, mode="train", use_cache=False, autocast_kernel_dtype="float32", tie_word_embeddings=False),
    # ---- compressed KV (windows of tokens pooled into extra keys)
    "deepseek_v4": _family(
        "DeepseekV4ForCausalLM", "DeepseekV4Config", ("heavily_compressed_attention", "compressed_sparse_attention"),
        moe=True, mixers=("DeepseekV4HCACompressor", "DeepseekV4CSACompressor", "DeepseekV4Indexer"),
        notes="each attention appends its compressor's pooled windows (8 and 4 tokens here) to its keys",
        **_COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=16, attention_dropout=0.0,
        q_lora_rank=16, o_groups=2, o_lora_rank=8, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, num_hidden_layers=2, sliding_window=8, index_n_heads=2,
        index_head_dim=8, index_topk=4, num_nextn_predict_layers=0, hc_mult=2, partial_rotary_factor=0.5,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"]),
})


def make_config(family: str):
    """The family's tiny config (a fresh transformers config object)."""
    import transformers

    spec = FAMILIES[family]
    config = getattr(transformers, spec.config_class)(**dict(spec.config))
    config.use_cache = False
    return config


def make_hybrid_model(family: str, attn_implementation: str = "eager", seed: int = 0) -> torch.nn.Module:
    """The family's tiny causal LM in float32 and training mode (the same weights for the same seed)."""
    import transformers

    spec = FAMILIES[family]
    config = make_config(family)
    extra = {"experts_implementation": "eager"} if spec.moe else {}
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model_class)._from_config(
        config, attn_implementation="eager", dtype=torch.float32, **extra)
    if attn_implementation != "eager":
        model.set_attn_implementation(attn_implementation)
    return model.train()


def layer_kinds(model_or_family) -> list[str]:
    """Each decoder layer's kind as its (text) config reports it (``Family.kinds_attribute``); an
    attention-free family without such an attribute: its mixer's class name for every layer."""
    if isinstance(model_or_family, str):
        spec, config = FAMILIES[model_or_family], make_config(model_or_family)
    else:
        config = model_or_family.config
        spec = next(f for f in FAMILIES.values() if f.model_class == type(model_or_family).__name__)
    config = config.get_text_config()
    if spec.kinds_attribute:
        return [str(kind) for kind in getattr(config, spec.kinds_attribute)][: config.num_hidden_layers]
    return [spec.mixers[0]] * config.num_hidden_layers
