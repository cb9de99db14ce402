"""An independent numpy implementation of the MTP head's equations, and the checks the
Rust tests hand to it.

    mtp_reference.py head SCENARIO.json
        Recomputes, from the checkpoint alone, every draft and every logit a recorded run
        of the Rust head produced; exits non-zero on any draft that differs or any logit
        outside the BF16 tolerance (|diff| <= max|logit| / 256, one BF16 step at the
        logits' scale).
    mtp_reference.py quantize DIR ROWS COLS
        Quantizes DIR/w.f32 with the numpy reference (nvfp4_reference.py) and compares with
        the Rust quantizer's bytes in DIR (codes.u8, scales.u8, global.f32): must be
        identical.

Where the Rust CPU kernels round to BF16 (every BF16 activation an op writes), this code
rounds too, so the two differ only by f32 summation order.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

VERBOSE = bool(__import__("os").environ.get("MTP_REFERENCE_VERBOSE"))
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "python" / "specdraft"))
# numpy alone: the package may not be built. `quantize` is imported as a lone module for
# its safetensors reader; the quantizer is the numpy reference.
import nvfp4_reference as q  # noqa: E402
import quantize as st  # noqa: E402


def bf16(x):
    """Round float32 to the nearest BF16 (ties to even), kept as float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return r.view(np.float32).reshape(x.shape)


def seq_sum(x):
    """Sum over the last axis in order, in float32 (as a Rust `iter().sum()` does)."""
    return np.cumsum(x.astype(np.float32), axis=-1, dtype=np.float32)[..., -1]


def dot8(x, w):
    """``x @ w.T`` in float32 with the CPU attention's order: eight lane accumulators over
    chunks of eight, the lanes summed in order, then the tail."""
    x, w = x.astype(np.float32), w.astype(np.float32)
    n = x.shape[-1]
    chunks = n // 8
    acc = np.zeros(x.shape[:-1] + (w.shape[0], 8), np.float32)
    for c in range(chunks):
        acc += x[..., None, c * 8 : (c + 1) * 8] * w[:, c * 8 : (c + 1) * 8]
    total = np.zeros(acc.shape[:-1], np.float32)
    for lane in range(8):
        total = total + acc[..., lane]
    for i in range(chunks * 8, n):
        total = total + x[..., None, i] * w[:, i]
    return total


def dot16(x, w):
    """``x @ w.T`` in float32 with the CPU ``linear``'s order: sixteen lane accumulators over
    chunks of sixteen, the lanes summed as a tree (halves added lane-wise: 16 -> 8 -> 4,
    then ``(q0 + q2) + (q1 + q3)``), then the tail."""
    x, w = x.astype(np.float32), w.astype(np.float32)
    n = x.shape[-1]
    chunks = n // 16
    acc = np.zeros(x.shape[:-1] + (w.shape[0], 16), np.float32)
    for c in range(chunks):
        acc += x[..., None, c * 16 : (c + 1) * 16] * w[:, c * 16 : (c + 1) * 16]
    h = acc[..., :8] + acc[..., 8:]
    q = h[..., :4] + h[..., 4:]
    total = (q[..., 0] + q[..., 2]) + (q[..., 1] + q[..., 3])
    for i in range(chunks * 16, n):
        total = total + x[..., None, i] * w[:, i]
    return total


def lane16_sum(x):
    """Sum over the last axis in float32 with the CPU RMSNorm's order: sixteen lanes (lane
    ``i % 16``, each in order, the tail zero-padded), then halves added lane-wise down to one."""
    x = x.astype(np.float32)
    n = x.shape[-1]
    padded = np.zeros(x.shape[:-1] + (-(-n // 16) * 16,), np.float32)
    padded[..., :n] = x
    lanes = np.zeros(x.shape[:-1] + (16,), np.float32)
    for c in range(padded.shape[-1] // 16):
        lanes = lanes + padded[..., c * 16 : (c + 1) * 16]
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = lanes[..., :half] + lanes[..., half:]
    return lanes[..., 0]


def exp_nonpositive(x):
    """``exp(x)`` for ``x <= 0`` in float32, step for step as the CPU kernels compute it
    (range reduction by ln 2 and a degree-6 polynomial; no fused multiply-add)."""
    f = np.float32
    x = np.maximum(np.asarray(x, np.float32), f(-87.0))
    magic = f(12_582_912.0)
    t = (x * f(np.log2(np.e))).astype(np.float32) + magic
    n = t - magic
    k = t.view(np.int32) - magic.view(np.int32)
    r = x - n * f(0.693_359_4) - n * f(-2.121_944_4e-4)
    p = f(1.987_569_1e-4)
    for c in (1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5):
        p = p * r + f(c)
    y = p * r * r + r + f(1.0)
    return (y * ((k + 127) << 23).astype(np.int32).view(np.float32)).astype(np.float32)


def sigmoid(g):
    """The CPU kernels' sigmoid: ``n / (1 + e)`` with ``e = exp(-|g|)``, ``n = 1`` for
    ``g >= 0`` and ``e`` otherwise (never overflows)."""
    g = np.asarray(g, np.float32)
    e = exp_nonpositive(-np.abs(g))
    n = np.where(g >= 0, np.float32(1.0), e).astype(np.float32)
    return (n / (np.float32(1.0) + e)).astype(np.float32)


def rms_norm(x, w, eps):
    x = x.astype(np.float32)
    mean = lane16_sum(x * x) / np.float32(x.shape[-1])
    inv = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
    return bf16(x * inv[..., None] * w)


def linear(x, w, b=None, post_bias=False):
    y = dot16(x, w)
    if b is not None and not post_bias:
        y = y + b
    y = bf16(y)
    if b is not None and post_bias:
        # An NVFP4 projection rounds to BF16 first, then adds its bias.
        y = bf16(y + b)
    return y


LAYOUTS = {
    "deepseek_v3": (
        "model.layers.{L}.",
        "model.layers.{L}.",
        ["enorm", "hnorm", "eh_proj", "shared_head.norm"],
    ),
    "glm4_moe": (
        "model.layers.{L}.",
        "model.layers.{L}.",
        ["enorm", "hnorm", "eh_proj", "shared_head.norm"],
    ),
    "mimo": (
        "model.mtp_layers.0.",
        "model.mtp_layers.0.",
        ["token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"],
    ),
    "qwen3_next": (
        "mtp.",
        "mtp.layers.0.",
        ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"],
    ),
}


class Head:
    def __init__(self, scen):
        ckpt = Path(scen["checkpoint"])
        cfg = json.loads((ckpt / "config.json").read_text())
        raw = {}
        for f in sorted(ckpt.glob("*.safetensors")):
            raw.update(st.read_safetensors(f))
        t = {n: st.to_float32(*v) for n, v in raw.items()}
        self.layout = scen["layout"]
        lv = scen["levers"]
        self.kv_exact, self.target_post, self.chain_post = (
            lv["mtp_kv_exact"],
            lv["mtp_target_postnorm"],
            lv["mtp_chain_postnorm"],
        )
        self.h, self.heads, self.kvh, self.hd = (
            cfg["hidden_size"],
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
            cfg["head_dim"],
        )
        self.eps = np.float32(cfg.get("rms_norm_eps", 1e-6))
        self.vocab = cfg["vocab_size"]
        zc = self.layout == "qwen3_next"
        self.gated = zc
        L = cfg["num_hidden_layers"]
        module, layer, names = LAYOUTS[self.layout]
        module, layer = module.format(L=L), layer.format(L=L)

        def norm(name):
            w = t[name]
            return bf16(np.float32(1.0) + w) if zc else w

        nvfp4, fp8 = scen["quant"] == "nvfp4", scen["quant"] == "fp8"

        def proj(name):
            w = t[name]
            if nvfp4:
                return q.dequantize_nvfp4(*q.quantize_nvfp4(w))
            if fp8:
                # The FP8 E4M3 grid under one power-of-two scale for the tensor.
                amax = np.float32(np.abs(w).max())
                scale = np.float32(2.0 ** int(np.ceil(np.log2(amax / np.float32(448.0)))))
                return q.fp8_e4m3_decode(q.fp8_e4m3_encode(w / scale)) * scale
            return w

        self.post_bias = nvfp4
        self.embed = t["model.embed_tokens.weight"]
        self.target_norm = norm("model.norm.weight")
        self.enorm, self.hnorm = (
            norm(f"{module}{names[0]}.weight"),
            norm(f"{module}{names[1]}.weight"),
        )
        self.eh = proj(f"{module}{names[2]}.weight")
        self.fnorm = norm(f"{module}{names[3]}.weight")
        p = layer
        self.attn_norm, self.ffn_norm = (
            norm(p + "input_layernorm.weight"),
            norm(p + "post_attention_layernorm.weight"),
        )
        self.wq, self.wk, self.wv, self.wo = (
            proj(p + f"self_attn.{x}_proj.weight") for x in "qkvo"
        )
        self.bq, self.bk, self.bv = (t.get(p + f"self_attn.{x}_proj.bias") for x in "qkv")
        self.qn = (
            norm(p + "self_attn.q_norm.weight") if p + "self_attn.q_norm.weight" in t else None
        )
        self.kn = (
            norm(p + "self_attn.k_norm.weight") if p + "self_attn.k_norm.weight" in t else None
        )
        self.moe = p + "mlp.gate.weight" in t
        mlp = "mlp"
        if self.moe:
            mlp = "mlp.shared_expert" if zc else "mlp.shared_experts"
            self.router = t[p + "mlp.gate.weight"]
            self.bias = t.get(p + "mlp.gate.e_score_correction_bias")
            self.shared_gate = t.get(p + "mlp.shared_expert_gate.weight")
            n = self.router.shape[0]
            self.experts = [
                tuple(proj(p + f"mlp.experts.{e}.{x}_proj.weight") for x in ("gate", "up", "down"))
                for e in range(n)
            ]
            self.softmax = zc
            self.top_k = cfg["num_experts_per_tok"]
            self.norm_topk = cfg.get("norm_topk_prob", True)
            self.scaling = np.float32(cfg.get("routed_scaling_factor", 1.0))
            self.n_group, self.topk_group = cfg.get("n_group", 1), cfg.get("topk_group", 1)
        self.wg, self.wu, self.wd = (
            proj(p + f"{mlp}.{x}_proj.weight") for x in ("gate", "up", "down")
        )
        head_name = f"{module}shared_head.head.weight"
        lm = (
            t[head_name]
            if self.layout in ("deepseek_v3", "glm4_moe") and head_name in t
            else t["lm_head.weight"]
        )
        self.lm = q.dequantize_nvfp4(*q.quantize_nvfp4(lm))  # the head always drafts through NVFP4
        vd = scen["mtp_vocab_size"] or self.vocab
        self.lm = self.lm[:vd]
        rd = max(
            2, min(self.hd, int(round(self.hd * cfg.get("partial_rotary_factor", 1.0))) // 2 * 2)
        )
        base = float(cfg.get("rope_theta", 10000.0))
        self.inv_freq = np.array(
            [1.0 / base ** (2.0 * i / rd) for i in range(rd // 2)], dtype=np.float64
        ).astype(np.float32)
        self.rows = []  # (pair key, k [kvh, hd], v [kvh, hd])

    def rope(self, x, pos):
        x = x.copy()
        half = len(self.inv_freq)
        ang = np.float32(pos) * self.inv_freq
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        a, b = x[:, :half].copy(), x[:, half : 2 * half].copy()
        x[:, :half] = bf16(a * cos - b * sin)
        x[:, half : 2 * half] = bf16(b * cos + a * sin)
        return x

    def step(self, token, hidden, pos, from_target, want_logits=True):
        """One row: writes its KV and returns (logits, chain hidden)."""
        e = rms_norm(self.embed[token], self.enorm, self.eps)
        g = hidden
        if from_target and self.target_post:
            g = rms_norm(g, self.target_norm, self.eps)
        g = rms_norm(g, self.hnorm, self.eps)
        cat = np.concatenate([g, e] if self.layout == "mimo" else [e, g])
        x = linear(cat[None], self.eh)[0]
        n = rms_norm(x, self.attn_norm, self.eps)
        pb = self.post_bias
        qf = linear(n[None], self.wq, self.bq, pb)[0]
        k = linear(n[None], self.wk, self.bk, pb)[0].reshape(self.kvh, self.hd)
        v = linear(n[None], self.wv, self.bv, pb)[0].reshape(self.kvh, self.hd)
        if self.gated:
            qf = qf.reshape(self.heads, 2 * self.hd)
            qh, gate = qf[:, : self.hd], qf[:, self.hd :].reshape(-1)
        else:
            qh, gate = qf.reshape(self.heads, self.hd), None
        if self.qn is not None:
            qh = rms_norm(qh, self.qn, self.eps)
            k = rms_norm(k, self.kn, self.eps)
        qh, k = self.rope(qh, pos), self.rope(k, pos)
        self.rows.append((pos - 1, k, v))
        if not want_logits:
            return None, None
        K = np.stack([r[1] for r in self.rows])  # [n, kvh, hd]
        V = np.stack([r[2] for r in self.rows])
        group = self.heads // self.kvh
        out = np.zeros((self.heads, self.hd), np.float32)
        scale = np.float32(1.0) / np.sqrt(np.float32(self.hd))
        for hh in range(self.heads):
            kv_h = hh // group
            sc = dot8(qh[hh], K[:, kv_h, :]) * scale
            p = np.exp(sc - sc.max()).astype(np.float32)
            total = seq_sum(p)
            for j in range(len(p)):
                out[hh] = out[hh] + (p[j] / total) * V[j, kv_h, :]
        attn = bf16(out).reshape(-1)
        if gate is not None:
            attn = bf16(attn * sigmoid(gate))
        x = bf16(x + linear(attn[None], self.wo)[0])
        n = rms_norm(x, self.ffn_norm, self.eps)
        x = bf16(x + self.mlp(n))
        o = rms_norm(x, self.fnorm, self.eps)
        logits = dot16(o, self.lm)
        return logits, (o if self.chain_post else x)

    @staticmethod
    def swiglu(n, wg, wu, wd):
        gg, uu = linear(n[None], wg)[0], linear(n[None], wu)[0]
        m = bf16(gg * sigmoid(gg) * uu)
        return linear(m[None], wd)[0]

    def route(self, logits):
        """(expert, weight) pairs, by descending weight (ties: lower index)."""
        n = len(logits)

        def order(v):
            return sorted(range(n), key=lambda i: (-v[i], i))

        if self.softmax:
            e = np.exp(logits - logits.max()).astype(np.float32)
            p = e / seq_sum(e)
            chosen = [(i, p[i]) for i in order(p)[: self.top_k]]
        else:
            sc = (np.float32(1.0) / (np.float32(1.0) + np.exp(-logits))).astype(np.float32)
            choice = sc + (self.bias if self.bias is not None else np.float32(0.0))
            g = self.n_group
            if g > 1 and self.topk_group < g:
                per = n // g
                gs = [
                    float(np.sort(choice[k * per : (k + 1) * per])[::-1][:2].sum())
                    for k in range(g)
                ]
                keep = sorted(range(g), key=lambda k: (-gs[k], k))[: self.topk_group]
                choice = np.array(
                    [c if i // per in keep else -np.inf for i, c in enumerate(choice)], np.float32
                )
            chosen = [(i, sc[i]) for i in order(choice)[: self.top_k]]
        w = np.array([c[1] for c in chosen], np.float32)
        if self.norm_topk:
            w = w / (seq_sum(w) + np.float32(1e-20))
        w = w * self.scaling
        return [(c[0], np.float32(wi)) for c, wi in zip(chosen, w, strict=True)]

    def mlp(self, n):
        """The MLP's output for the normed row `n` (dense, or shared + routed experts)."""
        out = self.swiglu(n, self.wg, self.wu, self.wd)
        if not self.moe:
            return out
        if self.shared_gate is not None:
            gl = linear(n[None], self.shared_gate)[0][0]
            out = bf16(out * bf16(np.float32(1.0) / (np.float32(1.0) + np.exp(-gl))))
        logits = dot16(n, self.router)
        for e, w in self.route(logits):
            y = self.swiglu(n, *self.experts[e])
            out = bf16(out + bf16(y * bf16(w)))
        return out

    def trim(self, newest_key):
        self.rows = [r for r in self.rows if r[0] <= newest_key]


def allowed(mask, t):
    return mask is None or (mask[t // 32] >> (t % 32)) & 1


def check_head(path):
    scen = json.loads(Path(path).read_text())
    head = Head(scen)
    hid = np.fromfile(scen["hiddens"], dtype="<f4").reshape(scen["hidden_rows"], head.h)
    toks = scen["tokens"]
    P = scen["prompt_len"]
    for i in range(1, P):
        head.step(toks[i], hid[i - 1], i, True, want_logits=False)
    failures, worst, worst_abs = [], 0.0, 0.0
    for r, rd in enumerate(scen["rounds"]):
        pos, last, n = rd["position"], rd["last_token"], rd["num_drafts"]
        assert toks[pos] == last, f"round {r}: token history mismatch"
        mask = None if rd["mask"] is None else [m & 0xFFFFFFFF for m in rd["mask"]]
        head.trim(pos - 2)
        drafts, token, hidden = [], last, hid[pos - 1]
        for j in range(n):
            logits, chain = head.step(token, hidden, pos + j, j == 0)
            got = np.asarray(rd["logits"][j], np.float32)
            tol = float(np.abs(logits).max()) / 256.0  # one BF16 step at the logits' scale
            err = float(np.abs(got - logits).max())
            worst = max(worst, err / tol)
            worst_abs = max(worst_abs, err)
            if VERBOSE:
                scale = float(np.abs(logits).max())
                print(f"round {r} step {j}: max |diff| {err:.5f}, max |logit| {scale:.3f}")
            if err > tol:
                failures.append(f"round {r} step {j}: max logit difference {err:.4f} > {tol:.4f}")
            masked = np.where([allowed(mask, t) for t in range(len(logits))], logits, -np.inf)
            pick = int(np.argmax(masked))
            top2 = np.sort(masked)[-2:]
            drafts.append(pick)
            if rd["drafts"][j] != pick:
                margin = top2[1] - top2[0]
                failures.append(
                    f"round {r} step {j}: Rust drafted {rd['drafts'][j]}, numpy {pick} "
                    f"(top-2 margin {margin:.4g})"
                )
            # Continue from the Rust draft so one disagreement does not cascade.
            token, hidden = rd["drafts"][j], chain
        k = rd["accepted"]
        if head.kv_exact:
            head.trim(pos - 1)
            for i in range(k):
                head.step(rd["drafts"][i], hid[pos + i], pos + 1 + i, True, want_logits=False)
        else:
            head.trim(pos - 1 + k)
    print(
        f"{scen['layout']} ({scen['quant']}, levers {scen['levers']}): "
        f"{len(scen['rounds'])} rounds, worst logit difference {worst_abs:.3g} "
        f"({worst:.3f} of the tolerance), {len(failures)} failures"
    )
    for f in failures:
        print("  " + f)
    return 0 if not failures else 1


def check_quantize(d, rows, cols):
    d = Path(d)
    w = np.fromfile(d / "w.f32", dtype="<f4").reshape(rows, cols)
    codes, scales, g = q.quantize_nvfp4(w)
    rc = np.fromfile(d / "codes.u8", dtype=np.uint8).reshape(codes.shape)
    rs = np.fromfile(d / "scales.u8", dtype=np.uint8).reshape(scales.shape)
    rg = np.fromfile(d / "global.f32", dtype="<f4")[0]
    bad = []
    if rg != g:
        bad.append(f"weight_scale_2: Rust {rg!r}, Python {g!r}")
    if not np.array_equal(rs, scales):
        i = np.argwhere(rs != scales)[0]
        n = int((rs != scales).sum())
        at = tuple(i)
        bad.append(f"{n} scales differ, first at {at}: Rust {rs[at]:#x}, Python {scales[at]:#x}")
    if not np.array_equal(rc, codes):
        i = np.argwhere(rc != codes)[0]
        n = int((rc != codes).sum())
        at = tuple(i)
        bad.append(f"{n} code bytes differ, first at {at}: Rust {rc[at]:#x}, Python {codes[at]:#x}")
    print(f"quantize {rows}x{cols}: " + ("identical" if not bad else "; ".join(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "head":
        sys.exit(check_head(sys.argv[2]))
    if len(sys.argv) == 5 and sys.argv[1] == "quantize":
        sys.exit(check_quantize(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    print(__doc__)
    sys.exit(2)
