"""NVFP4: the numpy reference quantizer (nvfp4_reference.py) against the format's formula
and round-trip bound, the Rust quantizer against the reference, and the
`specdraft quantize --nvfp4` conversion of a checkpoint."""

from __future__ import annotations

import json

import numpy as np
import nvfp4_reference as q
import pytest
import specdraft
from specdraft import quantize as cli


def test_fp8_encode_inverts_decode_on_every_finite_code():
    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF, 0x80)], dtype=np.uint8)
    assert np.array_equal(q.fp8_e4m3_encode(q.fp8_e4m3_decode(codes)), codes)
    # Ties go to the even mantissa; out-of-range values saturate at +-448.
    assert q.fp8_e4m3_encode(np.float32([1.0625, 1.1875, 1e9, -1e9])).tolist() == [
        0x38,
        0x3A,
        0x7E,
        0xFE,
    ]


def test_dequantize_is_the_formula():
    w = np.array([[0x21, 0xF8] + [0] * 6], dtype=np.uint8)  # codes 1, 2, 8, 15, ...
    s = np.array([[0x38]], dtype=np.uint8)  # 1.0
    d = q.dequantize_nvfp4(w, s, np.float32(0.5))
    assert d[0, :4].tolist() == [0.5 * 0.5, 1.0 * 0.5, -0.0, -6.0 * 0.5]


def test_round_trip_is_within_the_format_bound():
    rng = np.random.default_rng(0)
    w = (rng.uniform(-1, 1, (16, 64)) ** 3 * 5).astype(np.float32)
    codes, scales, g = q.quantize_nvfp4(w)
    assert g == np.float32(np.abs(w).max() / np.float32(6 * 448))
    d = q.dequantize_nvfp4(codes, scales, g)
    blocks = w.reshape(16, 4, 16)
    s = (np.abs(blocks).max(axis=2) / (np.float32(6) * g)).astype(np.float32)
    sq = q.fp8_e4m3_decode(scales)
    bound = g * (sq + 6 * np.abs(s - sq)) * 1.0001
    err = np.abs(d.reshape(16, 4, 16) - blocks)
    assert np.all(err <= bound[:, :, None])
    assert np.sqrt((err**2).sum() / (w**2).sum()) < 0.12


def test_rust_quantizer_makes_the_references_bytes():
    rng = np.random.default_rng(3)
    for w in (
        (rng.uniform(-1, 1, (8, 64)) ** 3 * 3).astype(np.float32),
        np.zeros((2, 32), np.float32),
        rng.normal(size=(3, 16)).astype(np.float32) * 1e-3,
    ):
        codes, scales, g = specdraft.quantize_nvfp4(w)
        pc, ps, pg = q.quantize_nvfp4(w)
        assert np.array_equal(codes, pc) and np.array_equal(scales, ps)
        assert np.float32(g) == pg


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        q.quantize_nvfp4(np.zeros((2, 24), np.float32))
    with pytest.raises(ValueError, match="finite"):
        q.quantize_nvfp4(np.full((1, 16), np.nan, np.float32))
    with pytest.raises(specdraft.SpecdraftError, match="16"):
        specdraft.quantize_nvfp4(np.zeros((2, 24), np.float32))


def _bf16_bytes(a: np.ndarray) -> bytes:
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()


def test_cli_converts_projections_and_keeps_the_rest(tmp_path):
    src, dst = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    rng = np.random.default_rng(1)
    proj = rng.normal(size=(8, 32)).astype(np.float32)
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": ("BF16", [8, 32], _bf16_bytes(proj)),
        "model.layers.0.input_layernorm.weight": ("BF16", [32], _bf16_bytes(np.ones(32))),
        "model.embed_tokens.weight": ("BF16", [4, 32], _bf16_bytes(np.ones((4, 32)))),
    }
    cli.write_safetensors(src / "model.safetensors", tensors)
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert cli.main(["--nvfp4", str(src), str(dst)]) == 0
    out = cli.read_safetensors(dst / "model.safetensors")
    base = "model.layers.0.self_attn.q_proj"
    assert out[base + ".weight"][:2] == ("U8", [8, 16])
    assert out[base + ".weight_scale"][:2] == ("F8_E4M3", [8, 2])
    assert out[base + ".weight_scale_2"][:2] == ("F32", [])
    for name in ("model.layers.0.input_layernorm.weight", "model.embed_tokens.weight"):
        assert out[name] == tensors[name]
    assert (dst / "config.json").read_text() == (src / "config.json").read_text()
    # The stored bytes are exactly what the reference makes of the BF16 values.
    w, s, g = q.quantize_nvfp4(cli.to_float32(*tensors[base + ".weight"]))
    assert out[base + ".weight"][2] == w.tobytes() and out[base + ".weight_scale"][2] == s.tobytes()
    assert np.frombuffer(out[base + ".weight_scale_2"][2], "<f4")[0] == g


def test_cli_reports_a_folder_without_weights(tmp_path, capsys):
    assert cli.main(["--nvfp4", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "no *.safetensors" in capsys.readouterr().err
