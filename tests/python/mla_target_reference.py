"""A tiny random DeepSeek-V3 target checkpoint (multi-head latent attention, a dense first
layer, then sigmoid group-routed experts with a shared expert), and an independent numpy
forward of it written from the published equations (Hugging Face's ``DeepseekV3Attention``
and DeepSeek-V3's MoE).

    mla_target_reference.py VARIANT DIR SEED TOKENS [GGUF [KV_B [EXPERTS]]]
        VARIANT is ``q_lora`` (the query through ``q_a_proj`` / ``q_a_layernorm`` /
        ``q_b_proj``), ``plain_q`` (``q_lora_rank: null``, one ``q_proj``) or ``yarn``
        (``q_lora`` with YaRN RoPE scaling, its ``mscale`` equal to ``mscale_all_dim`` as in
        DeepSeek-V3, so the score scale grows by ``mscale(factor, mscale_all_dim)^2``) or
        ``fp8`` (``q_lora`` with every ``*_proj`` stored as E4M3 with ``weight_scale_inv``
        per 128 x 128 block, as DeepSeek-V3 ships; the forward uses the dequantized
        values) or ``mtp`` (``q_lora`` plus DeepSeek-V3's own MTP layer,
        ``model.layers.3.*``: ``enorm``, ``hnorm``, ``eh_proj``, an MLA decoder layer with
        routed and shared experts, ``shared_head.norm`` and ``shared_head.head``). Writes
        DIR/config.json and DIR/model.safetensors (BF16), runs the forward over TOKENS
        (comma-separated ids) and writes DIR/reference.json: ``{"logits": [[...] per
        position], "min_margin": float, "sparse_layers": [...], "latents": [[[...] per
        position] per layer]}``. ``latents`` is what DeepSeek-V3's absorbed inference caches
        per token: ``[kv_a_layernorm(c_kv) | rope(k_pe)]``, RoPE rotating adjacent pairs in
        place. ``min_margin`` is as in ``moe_target_reference.py``. With ``mtp``, also
        ``"hiddens"``: the target's hidden at every position before the final norm (BF16
        values), ``"mtp_logits"``: the MTP layer's logits at positions 1 .. n - 1 (see
        below), its routing margins counted in ``min_margin``, and ``"mtp_latents"``: its
        cached latent rows at those positions. With GGUF, also writes the same main-model
        weights to that GGUF file as llama.cpp's ``deepseek2`` (needs the ``gguf`` package):
        KV_B ``split`` (the default; ``attn_k_b`` / ``attn_v_b`` and the ``*_mla`` keys, as
        llama.cpp's converter writes today) or ``kv_b`` (one ``attn_kv_b``, as its first
        conversions did), the stacked experts as EXPERTS (``f32``, the default, or ``q8_0``).

The attention, per layer (pre-norm, x = rms_norm(h)):
    q = q_b(rms_norm(q_a(x), q_a_layernorm))  (or q_proj(x)), per head [q_nope | q_pe];
    [c_kv | k_pe] = kv_a_proj_with_mqa(x);  c_kv = rms_norm(c_kv, kv_a_layernorm);
    per head [k_nope | v] = kv_b_proj(c_kv);  k = [k_nope | k_pe] (k_pe shared by the heads);
    q_pe, k_pe rotated the ``transformers`` way with ``rope_interleave``: de-interleave
    (even elements, then odd), then rotate-half;
    softmax(q . k / sqrt(qk_nope_head_dim + qk_rope_head_dim)) causal (the scale times
    mscale(factor, mscale_all_dim)^2 under YaRN, whose frequencies are ``transformers``'),
    times v; o_proj.
The MLP: layer 0 a dense SwiGLU (first_k_dense_replace = 1), the others s = sigmoid(router
x), experts chosen by s + e_score_correction_bias among the topk_group best of n_group groups
(a group scoring the sum of its two best), weights the chosen s over their sum times
routed_scaling_factor, plus the shared expert.

The MTP layer (DeepSeek-V3's paper, section 2.2; ``model.layers.{num_hidden_layers}``): its row
at position p (1 <= p < n) is h = eh_proj([enorm(embed(token_p)) | hnorm(h_target_{p-1})]),
the embedding first and h_target the main model's hidden before its final norm; then one
decoder layer as above (latent attention over the MTP rows of positions 1 .. p, RoPE at p;
routed and shared experts), and logits = shared_head.head(shared_head.norm(h)).

Sums run in float64. Where the Rust CPU backend stores an activation in BF16 by design (every
projection's output, every norm's, RoPE's, attention's, the cached latent), this rounds to
BF16 too, so that what is left between the two is summation order; the per-head keys and
values ``kv_b_proj`` makes, which ``transformers`` rounds to BF16 but the absorbed form never
forms, stay unrounded (rounding them alone moves these logits by up to 0.09).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "python" / "specdraft"))
import quantize as st  # noqa: E402  (its safetensors writer; numpy only)
from moe_target_reference import bf16, fp8_blocks, linear, rms_norm, swiglu  # noqa: E402

H, HEADS, FFN, VOCAB, LAYERS = 64, 4, 96, 96, 3
EXPERTS, EXPERT_FFN = 8, 32
Q_LORA, KV_LORA, NOPE, ROPE, VDIM = 24, 32, 16, 8, 12


def config_of(variant: str) -> dict:
    """The tiny config.json of ``variant``."""
    if variant not in ("q_lora", "plain_q", "yarn", "fp8", "mtp"):
        raise SystemExit(f"unknown variant {variant!r}: q_lora, plain_q, yarn, fp8 or mtp")
    cfg = {
        "model_type": "deepseek_v3",
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "q_lora_rank": None if variant == "plain_q" else Q_LORA,
        "kv_lora_rank": KV_LORA,
        "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE,
        "v_head_dim": VDIM,
        "n_routed_experts": EXPERTS,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": EXPERT_FFN,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }
    if variant == "mtp":
        cfg["num_nextn_predict_layers"] = 1
    if variant == "fp8":
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
            "activation_scheme": "dynamic",
        }
    if variant == "yarn":
        cfg["rope_scaling"] = {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.8,
            "mscale_all_dim": 0.8,
        }
    return cfg


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * np.log(factor) + 1.0


def inv_freq(cfg: dict) -> np.ndarray:
    """RoPE's inverse frequencies over the ROPE rotated elements; with YaRN, as
    ``transformers``' ``_compute_yarn_parameters`` blends them."""
    base = cfg["rope_theta"]
    pos_freqs = base ** (np.arange(0, ROPE, 2) / ROPE)
    rs = cfg.get("rope_scaling")
    if not rs:
        return 1.0 / pos_freqs
    factor, old = rs["factor"], rs["original_max_position_embeddings"]

    def correction_dim(rotations):
        return ROPE * np.log(old / (rotations * 2 * np.pi)) / (2 * np.log(base))

    low = max(np.floor(correction_dim(rs["beta_fast"])), 0)
    high = min(np.ceil(correction_dim(rs["beta_slow"])), ROPE - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(ROPE // 2) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation


def softmax_scale(cfg: dict) -> float:
    """DeepSeek-V3's score scale: 1 / sqrt(qk_head_dim), times mscale(factor,
    mscale_all_dim) squared under YaRN."""
    scale = 1 / np.sqrt(NOPE + ROPE)
    rs = cfg.get("rope_scaling")
    if rs and rs.get("mscale_all_dim"):
        scale *= yarn_mscale(rs["factor"], rs["mscale_all_dim"]) ** 2
    return scale


def write_checkpoint(variant: str, folder: Path, seed: int) -> dict:
    """Writes the random BF16 checkpoint; returns its tensors as float64 arrays."""
    cfg = config_of(variant)
    rng = np.random.default_rng(seed)
    t: dict[str, np.ndarray] = {}

    def put(name, shape, scale, base=0.0):
        t[name] = bf16(base + rng.uniform(-scale, scale, shape))

    def mlp(prefix, width):
        put(f"{prefix}.gate_proj.weight", [width, H], 1.5 / np.sqrt(H))
        put(f"{prefix}.up_proj.weight", [width, H], 1.5 / np.sqrt(H))
        put(f"{prefix}.down_proj.weight", [H, width], 1.5 / np.sqrt(width))

    put("model.embed_tokens.weight", [VOCAB, H], 1.0)
    put("model.norm.weight", [H], 0.2, 1.0)
    put("lm_head.weight", [VOCAB, H], 3 / np.sqrt(H))
    mtp = variant == "mtp"
    for i in range(LAYERS + mtp):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if i == LAYERS:
            # The MTP layer's own parts; its head is the main LM head, as DeepSeek-V3's is.
            for norm in ("enorm", "hnorm", "shared_head.norm"):
                put(f"{p}{norm}.weight", [H], 0.2, 1.0)
            put(p + "eh_proj.weight", [H, 2 * H], 1.5 / np.sqrt(2 * H))
            t[p + "shared_head.head.weight"] = t["lm_head.weight"]
        put(p + "input_layernorm.weight", [H], 0.2, 1.0)
        put(p + "post_attention_layernorm.weight", [H], 0.2, 1.0)
        if cfg["q_lora_rank"]:
            put(a + "q_a_proj.weight", [Q_LORA, H], 1.5 / np.sqrt(H))
            put(a + "q_a_layernorm.weight", [Q_LORA], 0.2, 1.0)
            put(a + "q_b_proj.weight", [HEADS * (NOPE + ROPE), Q_LORA], 2.0 / np.sqrt(Q_LORA))
        else:
            put(a + "q_proj.weight", [HEADS * (NOPE + ROPE), H], 2.0 / np.sqrt(H))
        put(a + "kv_a_proj_with_mqa.weight", [KV_LORA + ROPE, H], 2.0 / np.sqrt(H))
        put(a + "kv_a_layernorm.weight", [KV_LORA], 0.2, 1.0)
        put(a + "kv_b_proj.weight", [HEADS * (NOPE + VDIM), KV_LORA], 2.0 / np.sqrt(KV_LORA))
        put(a + "o_proj.weight", [H, HEADS * VDIM], 1.5 / np.sqrt(HEADS * VDIM))
        if i < cfg["first_k_dense_replace"]:
            mlp(p + "mlp", FFN)
            continue
        put(p + "mlp.gate.weight", [EXPERTS, H], 4 / np.sqrt(H))
        put(p + "mlp.gate.e_score_correction_bias", [EXPERTS], 0.05)
        mlp(p + "mlp.shared_experts", EXPERT_FFN * cfg["n_shared_experts"])
        for e in range(EXPERTS):
            mlp(f"{p}mlp.experts.{e}", EXPERT_FFN)
    folder.mkdir(parents=True, exist_ok=True)
    raw = {}
    for name, a in t.items():
        if variant == "fp8" and "_proj" in name and name.endswith(".weight"):
            codes, scale = fp8_blocks(a)
            raw[name] = ("F8_E4M3", list(a.shape), codes.tobytes())
            scale_name = name.replace(".weight", ".weight_scale_inv")
            raw[scale_name] = ("F32", list(scale.shape), scale.astype("<f4").tobytes())
            # One block each at these sizes: the values the model computes with. kv_b_proj
            # is dequantized to BF16 at load (the latent attention reads it in BF16).
            t[name] = codes.astype(np.float64) * float(scale[0, 0])
            if name.endswith("kv_b_proj.weight"):
                t[name] = bf16(t[name])
            continue
        bits = a.astype(np.float32).view(np.uint32) >> 16
        raw[name] = ("BF16", list(a.shape), bits.astype("<u2").tobytes())
    st.write_safetensors(folder / "model.safetensors", raw)
    (folder / "config.json").write_text(json.dumps(cfg))
    return t


def write_gguf(cfg: dict, t: dict, path: Path, kv_b: str = "split", experts: str = "f32"):
    """The main model's weights as a ``deepseek2`` GGUF with llama.cpp's names and keys (F32
    tensors, which hold the BF16 values exactly; the stacked experts Q8_0 blocks with
    ``experts="q8_0"``). Tensors are stored as Hugging Face lays them out, no rows permuted:
    llama.cpp rotates adjacent pairs in the RoPE parts, as DeepSeek's code does."""
    import gguf
    from gguf.quants import quantize

    if kv_b not in ("split", "kv_b") or experts not in ("f32", "q8_0"):
        raise SystemExit(f"KV_B {kv_b!r} / EXPERTS {experts!r}: split or kv_b / f32 or q8_0")
    split = kv_b == "split"
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(LAYERS)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    # The split form caches the latent as one KV head of its width; the first form kept
    # per-head sizes in these keys.
    w.add_head_count_kv(1 if split else HEADS)
    w.add_key_length(KV_LORA + ROPE if split else NOPE + ROPE)
    w.add_value_length(KV_LORA if split else VDIM)
    if split:
        w.add_key_length_mla(NOPE + ROPE)
        w.add_value_length_mla(VDIM)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_rope_dimension_count(ROPE)
    rs = cfg.get("rope_scaling")
    if rs and rs["type"] == "yarn":
        # As llama.cpp's converter writes DeepSeek-V3's YaRN: mscale_all_dim as a log
        # multiplier, no betas (llama.cpp's defaults are DeepSeek's).
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rs["factor"])
        w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rs["mscale_all_dim"])
    w.add_vocab_size(VOCAB)
    if cfg["q_lora_rank"]:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(KV_LORA)
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(EXPERT_FFN)
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])

    def put(name, a):
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))

    put("token_embd.weight", t["model.embed_tokens.weight"])
    put("output_norm.weight", t["model.norm.weight"])
    put("output.weight", t["lm_head.weight"])
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_a_proj.weight": "attn_q_a.weight",
        "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
        "self_attn.q_b_proj.weight": "attn_q_b.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
        "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate.weight": "ffn_gate_inp.weight",
        "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    }
    for proj in ["gate", "up", "down"]:
        names[f"mlp.{proj}_proj.weight"] = f"ffn_{proj}.weight"
        names[f"mlp.shared_experts.{proj}_proj.weight"] = f"ffn_{proj}_shexp.weight"
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for hf, g in names.items():
            if p + hf in t:
                put(f"blk.{i}.{g}", t[p + hf])
        kv = t[p + "self_attn.kv_b_proj.weight"]
        if split:
            per_head = kv.reshape(HEADS, NOPE + VDIM, KV_LORA)
            put(f"blk.{i}.attn_k_b.weight", per_head[:, :NOPE].transpose(0, 2, 1))
            put(f"blk.{i}.attn_v_b.weight", per_head[:, NOPE:])
        else:
            put(f"blk.{i}.attn_kv_b.weight", kv)
        if i < cfg["first_k_dense_replace"]:
            continue
        for proj in ["gate", "up", "down"]:
            stack = np.stack([t[f"{p}mlp.experts.{e}.{proj}_proj.weight"] for e in range(EXPERTS)])
            name = f"blk.{i}.ffn_{proj}_exps.weight"
            if experts == "f32":
                put(name, stack)
                continue
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, quantize(stack.astype(np.float32), q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rope_angles(positions, inv):
    """cos and sin, ``[n, ROPE]``, as ``transformers`` builds them (each frequency twice)."""
    ang = positions[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], axis=-1)
    return np.cos(ang), np.sin(ang)


def rope_hf_interleave(x, cos, sin):
    """``apply_rotary_pos_emb_interleave`` on x ``[n, heads, ROPE]``: de-interleave, then
    rotate-half."""
    x = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    half = ROPE // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return bf16(x * cos[:, None, :] + rotated * sin[:, None, :])


def rope_in_place(x, positions, inv):
    """DeepSeek's own ``apply_rotary_emb``: pairs (2i, 2i + 1) as complex numbers, rotated
    in place; x ``[n, ROPE]``."""
    z = (x[:, 0::2] + 1j * x[:, 1::2]) * np.exp(1j * positions[:, None] * inv[None, :])
    out = np.empty_like(x)
    out[:, 0::2], out[:, 1::2] = z.real, z.imag
    return bf16(out)


class Forward:
    """The whole model over one token sequence, recording routing margins and latents."""

    def __init__(self, cfg: dict, t: dict):
        self.cfg, self.t = cfg, t
        self.margins: list[float] = []
        self.latents: list[list[list[float]]] = []

    def attention(self, a, x, pos):
        """The latent attention of the rows ``x`` at RoPE positions ``pos``, each row
        attending to itself and the rows before it."""
        t, n, eps = self.t, x.shape[0], self.cfg["rms_norm_eps"]
        if self.cfg["q_lora_rank"]:
            qa = rms_norm(linear(x, t[a + "q_a_proj.weight"]), t[a + "q_a_layernorm.weight"], eps)
            q = linear(qa, t[a + "q_b_proj.weight"])
        else:
            q = linear(x, t[a + "q_proj.weight"])
        q = q.reshape(n, HEADS, NOPE + ROPE)
        q_nope, q_pe = q[..., :NOPE], q[..., NOPE:]
        ckv = linear(x, t[a + "kv_a_proj_with_mqa.weight"])
        c_kv, k_pe = ckv[:, :KV_LORA], ckv[:, KV_LORA:]
        c_kv = rms_norm(c_kv, t[a + "kv_a_layernorm.weight"], eps)
        # Per-head keys and values are never stored (the absorbed form never forms them),
        # so they stay unrounded here.
        kv = (c_kv @ t[a + "kv_b_proj.weight"].T).reshape(n, HEADS, NOPE + VDIM)
        k_nope, v = kv[..., :NOPE], kv[..., NOPE:]
        inv = inv_freq(self.cfg)
        cos, sin = rope_angles(pos, inv)
        q_pe = rope_hf_interleave(q_pe, cos, sin)
        k_pe_rot = rope_hf_interleave(k_pe[:, None, :], cos, sin)
        self.latents.append(np.concatenate([c_kv, rope_in_place(k_pe, pos, inv)], axis=-1).tolist())
        k = np.concatenate([k_nope, np.repeat(k_pe_rot, HEADS, axis=1)], axis=-1)
        q = np.concatenate([q_nope, q_pe], axis=-1)
        causal = np.tril(np.ones((n, n), bool))
        out = np.zeros((n, HEADS, VDIM))
        for h in range(HEADS):
            s = q[:, h] @ k[:, h].T * softmax_scale(self.cfg)
            s = np.where(causal, s, -np.inf)
            w = np.exp(s - s.max(axis=1, keepdims=True))
            w /= w.sum(axis=1, keepdims=True)
            out[:, h] = w @ v[:, h]
        return linear(bf16(out.reshape(n, HEADS * VDIM)), t[a + "o_proj.weight"])

    def margin(self, scores, k):
        """The gap between the k-th best score and the next."""
        s = np.sort(scores)[::-1]
        return float(s[k - 1] - s[k]) if k < len(s) else float("inf")

    def route(self, p, logits):
        """(expert, weight) pairs by descending weight, for one row's router logits."""
        cfg, k = self.cfg, self.cfg["num_experts_per_tok"]
        s = 1.0 / (1.0 + np.exp(-logits))
        choice = s + self.t[p + "mlp.gate.e_score_correction_bias"]
        groups, keep = cfg["n_group"], cfg["topk_group"]
        per = EXPERTS // groups
        gscore = np.array([np.sort(g)[::-1][:2].sum() for g in choice.reshape(groups, per)])
        self.margins.append(self.margin(gscore, keep))
        kept = np.argsort(-gscore)[:keep]
        masked = np.array([c if e // per in kept else -np.inf for e, c in enumerate(choice)])
        self.margins.append(self.margin(masked, k))
        chosen = list(np.argsort(-masked)[:k])
        w = s[chosen]
        w = w / w.sum() * cfg["routed_scaling_factor"]
        order = sorted(range(k), key=lambda i: (-w[i], chosen[i]))
        return [(int(chosen[i]), float(w[i])) for i in order]

    def moe(self, p, x):
        t = self.t
        acc = swiglu(t, p + "mlp.shared_experts", x)
        logits = x @ t[p + "mlp.gate.weight"].T
        for r in range(x.shape[0]):
            for e, w in self.route(p, logits[r]):
                y = swiglu(t, f"{p}mlp.experts.{e}", x[r : r + 1])[0]
                acc[r] = bf16(acc[r] + bf16(y * bf16(w)))
        return acc

    def layer(self, i, h, pos):
        """Decoder layer ``i`` over the residual rows ``h`` at RoPE positions ``pos``."""
        t, eps, p = self.t, self.cfg["rms_norm_eps"], f"model.layers.{i}."
        x = rms_norm(h, t[p + "input_layernorm.weight"], eps)
        h = bf16(h + self.attention(p + "self_attn.", x, pos))
        x = rms_norm(h, t[p + "post_attention_layernorm.weight"], eps)
        dense = i < self.cfg["first_k_dense_replace"]
        return bf16(h + (swiglu(t, p + "mlp", x) if dense else self.moe(p, x)))

    def hiddens(self, tokens):
        """The main model's hidden at every position, before the final norm."""
        h = self.t["model.embed_tokens.weight"][np.asarray(tokens)]
        pos = np.arange(len(tokens), dtype=np.float64)
        for i in range(LAYERS):
            h = self.layer(i, h, pos)
        return h

    def logits(self, hiddens):
        """The main model's logits from its hiddens."""
        t, eps = self.t, self.cfg["rms_norm_eps"]
        return rms_norm(hiddens, t["model.norm.weight"], eps) @ t["lm_head.weight"].T

    def mtp_logits(self, tokens, hiddens):
        """The MTP layer's logits at positions 1 .. n - 1: the row at p from token p and the
        main model's hidden at p - 1."""
        t, eps, p = self.t, self.cfg["rms_norm_eps"], f"model.layers.{LAYERS}."
        e = rms_norm(
            t["model.embed_tokens.weight"][np.asarray(tokens[1:])], t[p + "enorm.weight"], eps
        )
        g = rms_norm(hiddens[:-1], t[p + "hnorm.weight"], eps)
        h = linear(np.concatenate([e, g], axis=-1), t[p + "eh_proj.weight"])
        h = self.layer(LAYERS, h, np.arange(1, len(tokens), dtype=np.float64))
        normed = rms_norm(h, t[p + "shared_head.norm.weight"], eps)
        return normed @ t[p + "shared_head.head.weight"].T


def main(argv: list[str]) -> int:
    if not 4 <= len(argv) <= 7:
        print(__doc__, file=sys.stderr)
        return 2
    variant, folder, seed, tokens = argv[0], Path(argv[1]), int(argv[2]), argv[3]
    ids = [int(x) for x in tokens.split(",")]
    t = write_checkpoint(variant, folder, seed)
    cfg = config_of(variant)
    if len(argv) >= 5:
        write_gguf(cfg, t, Path(argv[4]), *argv[5:])
    fwd = Forward(cfg, t)
    hiddens = fwd.hiddens(ids)
    out = {
        "logits": fwd.logits(hiddens).tolist(),
        "sparse_layers": [i for i in range(LAYERS) if i >= cfg["first_k_dense_replace"]],
        "latents": list(fwd.latents),
    }
    if variant == "mtp":
        out["hiddens"] = hiddens.tolist()
        out["mtp_logits"] = fwd.mtp_logits(ids, hiddens).tolist()
        out["mtp_latents"] = fwd.latents[LAYERS]
    out["min_margin"] = min(fwd.margins, default=1e9)
    (folder / "reference.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
