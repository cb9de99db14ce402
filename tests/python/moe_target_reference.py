"""A tiny random mixture-of-experts target checkpoint, and an independent numpy forward of
it written from the published equations (Hugging Face's GLM-4.5 and Qwen3-MoE models).

    moe_target_reference.py FAMILY DIR SEED TOKENS [GGUF [EXPERTS]]
        Writes DIR/config.json and DIR/model.safetensors (BF16) of a tiny random FAMILY
        (glm4_moe or qwen3_moe; with a ``+fp8`` suffix, its projections FP8 in 128 x 128
        blocks with ``weight_scale_inv``) target, runs the forward over TOKENS (comma-separated ids)
        and writes DIR/reference.json: ``{"logits": [[...] per position],
        "min_margin": float, "sparse_layers": [...]}``. ``min_margin`` is the smallest
        gap, over every routed row and layer, between the last expert (or group) chosen and
        the first one not chosen (in router logits for softmax routing, in biased sigmoid
        scores for sigmoid routing): routing is discrete, so a comparison is only
        meaningful when numerical noise cannot flip a choice. With GGUF, also writes the
        same weights to that GGUF file (needs the ``gguf`` package), the stacked experts as
        EXPERTS (``f32``, the default, or ``q8_0``), or broken on purpose: ``flat_experts``
        (``ffn_up_exps`` as a 2-D matrix), ``softmax_gating`` (a glm4moe file whose
        ``expert_gating_func`` is softmax), ``no_expert_count``.

The equations, per decoder layer (pre-norm):
    h += o_proj(attention(rope(q_norm?(q_proj x')), rope(k_norm?(k_proj x')), v_proj x'))
        with x' = rms_norm(h), grouped-query causal attention, RoPE of the rotate-half kind
        on the first ``partial_rotary_factor * head_dim`` elements of each head;
    h += mlp(rms_norm(h)), the MLP being a dense SwiGLU ``down(silu(gate x) * up x)`` or
        routed experts:
        - GLM-4.5 (sigmoid, "noaux_tc"): s = sigmoid(router x); experts are chosen by
          s + e_score_correction_bias, among the topk_group best of n_group groups (a group
          scores the sum of its two best); weights are the chosen s, divided by their sum
          when norm_topk_prob, times routed_scaling_factor; plus the shared experts.
        - Qwen3-MoE (softmax): p = softmax(router x), top k, divided by their sum when
          norm_topk_prob; no shared expert.
        Dense layers: GLM's first ``first_k_dense_replace``; Qwen3-MoE's ``mlp_only_layers``
        and those whose ``layer + 1`` is not a multiple of ``decoder_sparse_step``.

Sums run in float64. Where the Rust CPU backend stores an activation in BF16 by design (the
residual stream, every op's output, the key/value cache, an expert weight as a BF16 scalar),
this rounds to BF16 too, so that what is left between the two is summation order.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python" / "specdraft"))
import quantize as st  # noqa: E402  (its safetensors writer; numpy only)

H, HEADS, KVH, HD, FFN, VOCAB, LAYERS = 64, 4, 2, 16, 96, 96, 3
EXPERTS, EXPERT_FFN = 8, 32


def bf16(x):
    """Rounds to the nearest BF16 value (ties to even), returned as float64."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def config_of(family: str) -> dict:
    """The tiny config.json of ``family``, with every MoE key the family reads."""
    cfg = {
        "model_type": family,
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KVH,
        "head_dim": HD,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "moe_intermediate_size": EXPERT_FFN,
    }
    if family == "glm4_moe":
        cfg.update(
            n_routed_experts=EXPERTS,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            attention_bias=True,
            partial_rotary_factor=0.5,
            use_qk_norm=False,
        )
    elif family == "qwen3_moe":
        cfg.update(
            num_experts=EXPERTS,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
    else:
        raise SystemExit(f"unknown family {family!r}: glm4_moe or qwen3_moe")
    return cfg


def is_sparse(cfg: dict, layer: int) -> bool:
    """Whether ``layer`` routes, by the family's rules."""
    if cfg["model_type"] == "glm4_moe":
        return layer >= cfg["first_k_dense_replace"]
    return layer not in cfg["mlp_only_layers"] and (layer + 1) % cfg["decoder_sparse_step"] == 0


def fp8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """E4M3 codes and f32 ``weight_scale_inv`` (one per 128 x 128 block, amax / 448) of
    ``w``, as DeepSeek-V3 and Qwen3's FP8 checkpoints store a projection."""
    import ml_dtypes

    rows, cols = w.shape
    grid = (-(-rows // 128), -(-cols // 128))
    scale = np.zeros(grid, np.float32)
    codes = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            scale[i, j] = max(np.abs(block).max(), 1e-12) / 448.0
            q = (block / scale[i, j]).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
            codes[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = q
    return codes, scale


def write_checkpoint(family: str, folder: Path, seed: int, fp8: bool = False) -> dict:
    """Writes the random BF16 checkpoint; returns its tensors as float64 arrays. With
    ``fp8`` every ``*_proj`` matrix is stored as E4M3 blocks with ``weight_scale_inv``
    (the router, embedding, head and norms stay BF16), and the returned tensors are the
    dequantized values the model computes with."""
    cfg = config_of(family)
    rng = np.random.default_rng(seed)
    t: dict[str, np.ndarray] = {}

    def put(name, shape, scale, base=0.0):
        t[name] = bf16(base + rng.uniform(-scale, scale, shape))

    def swiglu(prefix, width):
        s = 1.5 / np.sqrt(H)
        put(f"{prefix}.gate_proj.weight", [width, H], s)
        put(f"{prefix}.up_proj.weight", [width, H], s)
        put(f"{prefix}.down_proj.weight", [H, width], 1.5 / np.sqrt(width))

    put("model.embed_tokens.weight", [VOCAB, H], 1.0)
    put("model.norm.weight", [H], 0.2, 1.0)
    put("lm_head.weight", [VOCAB, H], 3 / np.sqrt(H))
    s = 1.5 / np.sqrt(H)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        put(p + "input_layernorm.weight", [H], 0.2, 1.0)
        put(p + "post_attention_layernorm.weight", [H], 0.2, 1.0)
        put(p + "self_attn.q_proj.weight", [HEADS * HD, H], s)
        put(p + "self_attn.k_proj.weight", [KVH * HD, H], s)
        put(p + "self_attn.v_proj.weight", [KVH * HD, H], s)
        put(p + "self_attn.o_proj.weight", [H, HEADS * HD], s)
        if cfg.get("attention_bias"):
            put(p + "self_attn.q_proj.bias", [HEADS * HD], 0.3)
            put(p + "self_attn.k_proj.bias", [KVH * HD], 0.3)
            put(p + "self_attn.v_proj.bias", [KVH * HD], 0.3)
        if family == "qwen3_moe":
            put(p + "self_attn.q_norm.weight", [HD], 0.2, 1.0)
            put(p + "self_attn.k_norm.weight", [HD], 0.2, 1.0)
        if not is_sparse(cfg, i):
            swiglu(p + "mlp", FFN)
            continue
        put(p + "mlp.gate.weight", [EXPERTS, H], 4 / np.sqrt(H))
        if family == "glm4_moe":
            put(p + "mlp.gate.e_score_correction_bias", [EXPERTS], 0.05)
            swiglu(p + "mlp.shared_experts", EXPERT_FFN * cfg["n_shared_experts"])
        for e in range(EXPERTS):
            swiglu(f"{p}mlp.experts.{e}", EXPERT_FFN)
    folder.mkdir(parents=True, exist_ok=True)
    raw = {}
    for name, a in t.items():
        if fp8 and name.endswith("_proj.weight"):
            codes, scale = fp8_blocks(a)
            raw[name] = ("F8_E4M3", list(a.shape), codes.tobytes())
            scale_name = name.replace(".weight", ".weight_scale_inv")
            raw[scale_name] = ("F32", list(scale.shape), scale.astype("<f4").tobytes())
            t[name] = (
                codes.astype(np.float64)
                * np.repeat(np.repeat(scale.astype(np.float64), 128, 0), 128, 1)[
                    : a.shape[0], : a.shape[1]
                ]
            )
            continue
        bits = a.astype(np.float32).view(np.uint32) >> 16
        raw[name] = ("BF16", list(a.shape), bits.astype("<u2").tobytes())
    st.write_safetensors(folder / "model.safetensors", raw)
    if fp8:
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
            "activation_scheme": "dynamic",
        }
    (folder / "config.json").write_text(json.dumps(cfg))
    return t


def write_gguf(cfg: dict, t: dict, path: Path, experts: str = "f32") -> None:
    """The same weights as a GGUF file with llama.cpp's ``qwen3moe`` / ``glm4moe`` names and
    keys (F32 tensors, which hold the BF16 values exactly): stacked ``ffn_*_exps`` experts,
    ``ffn_gate_inp``, ``ffn_*_shexp``, ``exp_probs_b.bias``; GLM's pre-MLP norm is
    ``post_attention_norm``. With ``experts="q8_0"`` the stacked experts are Q8_0 blocks,
    and ``check.blk.{i}.ffn_{gate,up,down}_exps.3.weight`` holds expert 3 quantized alone.
    The other values of ``experts`` break the file as ``main``'s usage says."""
    import gguf
    from gguf.quants import quantize

    glm = cfg["model_type"] == "glm4_moe"
    arch = "glm4moe" if glm else "qwen3moe"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KVH)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_rope_dimension_count(int(round(HD * cfg.get("partial_rotary_factor", 1.0))))
    w.add_vocab_size(VOCAB)
    if experts != "no_expert_count":
        w.add_expert_count(EXPERTS)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(EXPERT_FFN)
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    if glm:
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        gating = gguf.ExpertGatingFuncType
        w.add_expert_gating_func(gating.SOFTMAX if experts == "softmax_gating" else gating.SIGMOID)
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])

    def put(name, a):
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))

    put("token_embd.weight", t["model.embed_tokens.weight"])
    put("output_norm.weight", t["model.norm.weight"])
    put("output.weight", t["lm_head.weight"])
    ffn_norm = "post_attention_norm.weight" if glm else "ffn_norm.weight"
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": ffn_norm,
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate.weight": "ffn_gate_inp.weight",
        "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    }
    for proj, g in [("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")]:
        names[f"self_attn.{proj}_proj.weight"] = f"{g}.weight"
        names[f"self_attn.{proj}_proj.bias"] = f"{g}.bias"
    for proj in ["gate", "up", "down"]:
        names[f"mlp.{proj}_proj.weight"] = f"ffn_{proj}.weight"
        names[f"mlp.shared_experts.{proj}_proj.weight"] = f"ffn_{proj}_shexp.weight"
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for hf, g in names.items():
            if p + hf in t:
                put(f"blk.{i}.{g}", t[p + hf])
        if is_sparse(cfg, i):
            for proj in ["gate", "up", "down"]:
                stack = [t[f"{p}mlp.experts.{e}.{proj}_proj.weight"] for e in range(EXPERTS)]
                name = f"blk.{i}.ffn_{proj}_exps"
                if experts == "flat_experts" and proj == "up":
                    put(f"{name}.weight", np.concatenate(stack))
                    continue
                if experts != "q8_0":
                    put(f"{name}.weight", np.stack(stack))
                    continue
                q8 = gguf.GGMLQuantizationType.Q8_0
                both = [(f"{name}.weight", np.stack(stack)), (f"check.{name}.3.weight", stack[3])]
                for n, a in both:
                    w.add_tensor(n, quantize(a.astype(np.float32), q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rms_norm(x, w, eps):
    return bf16(x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w)


def linear(x, w, b=None):
    y = x @ w.T
    return bf16(y if b is None else y + b)


def silu(x):
    return x / (1.0 + np.exp(-x))


def swiglu(t, prefix, x):
    g = linear(x, t[f"{prefix}.gate_proj.weight"])
    u = linear(x, t[f"{prefix}.up_proj.weight"])
    return linear(bf16(silu(g) * u), t[f"{prefix}.down_proj.weight"])


class Forward:
    """The whole model over one token sequence, recording routing margins."""

    def __init__(self, cfg: dict, t: dict):
        self.cfg, self.t = cfg, t
        self.margins: list[float] = []

    def rope(self, x, positions):
        """Rotate-half RoPE on the first rotary_dim elements of each head; x: [n, heads, hd]."""
        rd = int(round(HD * self.cfg.get("partial_rotary_factor", 1.0)))
        inv = self.cfg["rope_theta"] ** (-np.arange(0, rd, 2) / rd)
        ang = positions[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., : rd // 2], x[..., rd // 2 : rd]
        out = x.copy()
        out[..., : rd // 2] = a * cos - b * sin
        out[..., rd // 2 : rd] = b * cos + a * sin
        return bf16(out)

    def attention(self, p, x):
        t, n, eps = self.t, x.shape[0], self.cfg["rms_norm_eps"]

        def bias(k):
            return t.get(p + f"self_attn.{k}_proj.bias")

        q = linear(x, t[p + "self_attn.q_proj.weight"], bias("q")).reshape(n, HEADS, HD)
        k = linear(x, t[p + "self_attn.k_proj.weight"], bias("k")).reshape(n, KVH, HD)
        v = linear(x, t[p + "self_attn.v_proj.weight"], bias("v")).reshape(n, KVH, HD)
        if p + "self_attn.q_norm.weight" in t:
            q = rms_norm(q, t[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, t[p + "self_attn.k_norm.weight"], eps)
        pos = np.arange(n, dtype=np.float64)
        q, k = self.rope(q, pos), self.rope(k, pos)
        out = np.zeros((n, HEADS, HD))
        group = HEADS // KVH
        causal = np.tril(np.ones((n, n), bool))
        for h in range(HEADS):
            s = q[:, h] @ k[:, h // group].T / np.sqrt(HD)
            s = np.where(causal, s, -np.inf)
            w = np.exp(s - s.max(axis=1, keepdims=True))
            w /= w.sum(axis=1, keepdims=True)
            out[:, h] = w @ v[:, h // group]
        return linear(bf16(out.reshape(n, HEADS * HD)), t[p + "self_attn.o_proj.weight"])

    def margin(self, scores, k):
        """The gap between the k-th best score and the next."""
        s = np.sort(scores)[::-1]
        return float(s[k - 1] - s[k]) if k < len(s) else float("inf")

    def route(self, p, logits):
        """(expert, weight) pairs by descending weight, for one row's router logits."""
        cfg, k = self.cfg, self.cfg["num_experts_per_tok"]
        if cfg["model_type"] == "qwen3_moe":
            prob = np.exp(logits - logits.max())
            prob /= prob.sum()
            self.margins.append(self.margin(logits, k))
            chosen = sorted(range(EXPERTS), key=lambda e: -prob[e])[:k]
            w = prob[chosen]
        else:
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
        if cfg["norm_topk_prob"]:
            w = w / w.sum()
        w = w * cfg.get("routed_scaling_factor", 1.0)
        order = sorted(range(k), key=lambda i: (-w[i], chosen[i]))
        return [(int(chosen[i]), float(w[i])) for i in order]

    def moe(self, p, x):
        t = self.t
        if p + "mlp.shared_experts.gate_proj.weight" in t:
            acc = swiglu(t, p + "mlp.shared_experts", x)
        else:
            acc = np.zeros_like(x)
        logits = x @ t[p + "mlp.gate.weight"].T
        for r in range(x.shape[0]):
            for e, w in self.route(p, logits[r]):
                y = swiglu(t, f"{p}mlp.experts.{e}", x[r : r + 1])[0]
                acc[r] = bf16(acc[r] + bf16(y * bf16(w)))
        return acc

    def logits(self, tokens):
        t, eps = self.t, self.cfg["rms_norm_eps"]
        h = t["model.embed_tokens.weight"][np.asarray(tokens)]
        for i in range(LAYERS):
            p = f"model.layers.{i}."
            h = bf16(h + self.attention(p, rms_norm(h, t[p + "input_layernorm.weight"], eps)))
            x = rms_norm(h, t[p + "post_attention_layernorm.weight"], eps)
            mlp = self.moe(p, x) if is_sparse(self.cfg, i) else swiglu(t, p + "mlp", x)
            h = bf16(h + mlp)
        return rms_norm(h, t["model.norm.weight"], eps) @ t["lm_head.weight"].T


def main(argv: list[str]) -> int:
    if len(argv) not in (4, 5, 6):
        print(__doc__, file=sys.stderr)
        return 2
    family, folder, seed, tokens = argv[0], Path(argv[1]), int(argv[2]), argv[3]
    family, fp8 = family.removesuffix("+fp8"), family.endswith("+fp8")
    ids = [int(x) for x in tokens.split(",")]
    t = write_checkpoint(family, folder, seed, fp8)
    cfg = config_of(family)
    if len(argv) >= 5:
        write_gguf(cfg, t, Path(argv[4]), *argv[5:])
    fwd = Forward(cfg, t)
    logits = fwd.logits(ids)
    out = {
        "logits": logits.tolist(),
        "min_margin": min(fwd.margins, default=1e9),
        "sparse_layers": [i for i in range(LAYERS) if is_sparse(cfg, i)],
    }
    (folder / "reference.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
