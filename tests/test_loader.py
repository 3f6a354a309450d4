"""Checkpoint loading: key layouts, the (1+w) norm shift exactly once, MoE expert forms, errors."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers import TINY_LAYERS, tiny_checkpoint
from mlx.utils import tree_flatten

from mtpipe.models.convert import convert
from mtpipe.models.loading import CheckpointError, MissingMTPWeightsError, load_shard, read_checkpoint
from mtpipe.models.shard import ShardSpec
from mtpipe.models.tiny import build_tiny_checkpoint, random_raw_weights, write_checkpoint


def params(path: Path, **kw) -> dict[str, mx.array]:
    return dict(tree_flatten(load_shard(path, **kw).model.parameters()))


def assert_same(a: dict[str, mx.array], b: dict[str, mx.array]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        assert mx.array_equal(a[k].astype(mx.float32), b[k].astype(mx.float32)).item(), k


@pytest.mark.parametrize("layout", ["hf_text", "separate_mtp", "sharded"])
def test_layouts_load_identically(tiny_root: Path, dense_ckpt: Path, layout: str) -> None:
    other = tiny_checkpoint(tiny_root, layout=layout)
    assert_same(params(dense_ckpt), params(other))


def test_norm_shift_applied_once_to_raw_only(dense_ckpt: Path, tmp_path: Path) -> None:
    raw = read_checkpoint(dense_ckpt)
    loaded = params(dense_ckpt)
    for name in ["layers.0.input_layernorm.weight", "layers.3.self_attn.q_norm.weight", "norm.weight",
                 "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight",
                 "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.self_attn.k_norm.weight"]:
        assert mx.allclose(loaded[name], raw[name] + 1.0).item(), name
    # The GatedDeltaNet gated norm is plain w: never shifted.
    assert mx.array_equal(loaded["layers.0.linear_attn.norm.weight"], raw["layers.0.linear_attn.norm.weight"]).item()
    # A converted (mlx) checkpoint is already shifted: loading it must not shift again.
    out = convert(dense_ckpt, tmp_path / "mlx", dtype="float32")
    assert "language_model.mtp.fc.weight" in mx.load(str(out / "model.safetensors"))
    assert_same(loaded, params(out))


def test_a_converted_backbone_beside_the_original_mtp_head_shifts_the_head_only(dense_ckpt: Path,
                                                                                 tmp_path: Path) -> None:
    """MTP added to a converted model: its backbone converted (shifted, conv1d transposed, no MTP) and
    the original checkpoint's `mtp.*` tensors in an `mtp.safetensors` beside it. The head's norms are
    raw and take their +1 (the conv1d says only that the backbone is converted)."""
    out = convert(dense_ckpt, tmp_path / "mixed", dtype="float32", mtp=False)
    original = mx.load(str(dense_ckpt / "model.safetensors"))
    mx.save_safetensors(str(out / "mtp.safetensors"), {k: v for k, v in original.items() if k.startswith("mtp.")},
                        metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
    mixed, whole = params(out), params(dense_ckpt)
    assert mx.allclose(mixed["mtp.norm.weight"], original["mtp.norm.weight"] + 1.0).item()
    assert_same(whole, mixed)
    # A shard of it (the last, with the head) loads the same from a directory of its tensors only.
    spec = ShardSpec(2, TINY_LAYERS, TINY_LAYERS)
    assert_same(params(dense_ckpt, spec=spec), params(out, spec=spec))


def test_a_log_keeps_its_stored_dtype_and_norms_shift_in_the_asked_one(dense_ckpt: Path, tmp_path: Path) -> None:
    """`--dtype bfloat16` (and `convert`'s default) leaves A_log as stored, as mlx-lm does: exp(A_log) is
    every GatedDeltaNet decay rate. The norms' 1 + w is taken in float32 and rounded once, to the dtype
    asked for: a float32 checkpoint loaded as bfloat16, a bfloat16 one loaded as float32."""
    loaded = params(dense_ckpt, dtype=mx.bfloat16)
    assert loaded["layers.0.linear_attn.A_log"].dtype == mx.float32
    assert loaded["layers.0.linear_attn.dt_bias"].dtype == mx.bfloat16
    stored = mx.load(str(dense_ckpt / "model.safetensors"))["model.language_model.norm.weight"]
    assert mx.array_equal(loaded["norm.weight"], (stored + 1.0).astype(mx.bfloat16)).item()
    out = convert(dense_ckpt, tmp_path / "bf16", dtype="bfloat16")
    converted = mx.load(str(out / "model.safetensors"))
    assert converted["language_model.model.layers.0.linear_attn.A_log"].dtype == mx.float32
    assert converted["language_model.model.layers.0.input_layernorm.weight"].dtype == mx.bfloat16

    half = tmp_path / "raw_bf16"
    half.mkdir()
    original = mx.load(str(dense_ckpt / "model.safetensors"))
    mx.save_safetensors(str(half / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in original.items()},
                        metadata={"format": "pt"})
    (half / "config.json").write_text((dense_ckpt / "config.json").read_text())
    norm = params(half, dtype=mx.float32)["norm.weight"]
    want = original["model.language_model.norm.weight"].astype(mx.bfloat16).astype(mx.float32) + 1.0
    assert mx.array_equal(norm, want).item()


def test_mlx_lm_loads_converted_backbone(dense_ckpt: Path, tmp_path: Path) -> None:
    from mlx_lm import load

    out = convert(dense_ckpt, tmp_path / "mlx", dtype="float32")
    model, _ = load(str(out))
    ours = load_shard(out).model
    x = mx.array([[5, 17, 42, 7, 99]])
    h, _ = ours.run_layers(ours.embed(x), ours.make_cache())
    assert mx.allclose(model(x), ours.lm_logits(ours.final_norm(h)), atol=1e-5).item()


def test_a_conversion_cut_short_leaves_nothing(dense_ckpt: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the files are written: neither a half-written model nor a leftover that a second try
    would refuse; the second try then writes it whole."""
    from mtpipe.models import convert as conversion

    written = conversion._write

    def interrupted(dst: Path, *args: object) -> None:
        written(dst, *args)
        raise KeyboardInterrupt

    monkeypatch.setattr(conversion, "_write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(dense_ckpt, tmp_path / "out", dtype="float32")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(conversion, "_write", written)
    (tmp_path / "out").mkdir()  # (an empty directory is taken)
    out = convert(dense_ckpt, tmp_path / "out", dtype="float32")
    assert (out / "config.json").is_file() and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_weight_file_its_index_lists_and_that_is_missing_is_named(tiny_root: Path, tmp_path: Path) -> None:
    """A sharded checkpoint whose download stopped halfway: the file is named, not the tensors it held."""
    import shutil

    sharded = build_tiny_checkpoint(layout="sharded", root=tiny_root)
    broken = shutil.copytree(sharded, tmp_path / "broken")
    last = sorted(broken.glob("model-*.safetensors"))[-1]
    last.unlink()
    with pytest.raises(FileNotFoundError, match=f"{last.name}, listed in model.safetensors.index.json, is missing"):
        load_shard(broken)
    with pytest.raises(FileNotFoundError, match=last.name):
        convert(broken, tmp_path / "out")


@pytest.mark.skipif(mx.default_device().type != mx.cpu, reason="MLX's CPU backend only")
def test_moe_experts_the_cpu_cannot_multiply_are_refused_at_load(moe_ckpt: Path, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """gather_mm runs float32 only on the CPU: a bfloat16 MoE shard is refused as it loads, saying what runs.
    Converting one is not running it: it is written (for a Mac, say), with a warning, and loads in float32."""
    with pytest.raises(CheckpointError, match="experts are bfloat16.*--dtype float32"):
        load_shard(moe_ckpt, dtype=mx.bfloat16)
    assert load_shard(moe_ckpt, dtype=mx.float32).model.parameter_bytes() > 0
    with caplog.at_level("WARNING"):
        out = convert(moe_ckpt, tmp_path / "bf16")  # (bfloat16: convert's default)
    assert "experts are bfloat16" in caplog.text
    assert load_shard(out, dtype=mx.float32).model.parameter_bytes() > 0
    assert (convert(moe_ckpt, tmp_path / "q", quantize=True) / "config.json").is_file()


def test_a_conversion_keeps_the_tokenizers_files_and_says_where_it_cannot_write(
        dense_ckpt: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import shutil

    src = shutil.copytree(dense_ckpt, tmp_path / "src")
    (src / "added_tokens.json").write_text("{}")
    (src / "chat_template.json").write_text('{"chat_template": ""}')
    out = convert(src, tmp_path / "out", dtype="float32")
    assert (out / "added_tokens.json").is_file() and (out / "chat_template.json").is_file()
    assert (out / "tokenizer.json").is_file()
    (tmp_path / "afile").write_text("")
    with pytest.raises(FileExistsError, match="afile is a file, not a directory"):
        convert(src, tmp_path / "afile" / "sub", dtype="float32")
    (src / "tokenizer.json").unlink()
    with caplog.at_level("WARNING"):
        convert(src, tmp_path / "weights-only", dtype="float32")
    assert "holds no tokenizer" in caplog.text


def test_a_conversion_stopped_by_sigterm_leaves_nothing(dense_ckpt: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`timeout`, systemd or `kill` stop a conversion with SIGTERM: it unwinds as Ctrl-C does (exit 143)."""
    import os
    import signal

    from mtpipe.coordinator.cli.main import main
    from mtpipe.models import convert as conversion

    written = conversion._write

    def stopped(dst: Path, *args: object) -> None:
        written(dst, *args)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(conversion, "_write", stopped)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as ended:
        main(["convert", "--hf-path", str(dense_ckpt), "--mlx-path", str(tmp_path / "out"), "--dtype", "float32"])
    assert ended.value.code == 143 and list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == before  # (the command's handler is its own)


def test_missing_mtp_weights_error(tiny_root: Path) -> None:
    path = build_tiny_checkpoint(layout="no_mtp", root=tiny_root)
    with pytest.raises(MissingMTPWeightsError) as err:
        load_shard(path)
    msg = str(err.value)
    assert "declares 1 MTP layer" in msg and "--no-mtp" in msg and "missing parameters" not in msg.lower()
    assert not load_shard(path, mtp=False).has_mtp  # and --no-mtp works


def test_moe_expert_forms(tmp_path: Path, moe_ckpt: Path) -> None:
    """Per-expert backbone + fused MTP (the opposite of the builder's default) loads the same."""
    raw = {k: v for k, v in mx.load(str(moe_ckpt / "model.safetensors")).items()}
    cfg = json.loads((moe_ckpt / "config.json").read_text())["text_config"]
    swapped: dict[str, mx.array] = {}
    for k, v in raw.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            prefix, I = k[: -len("gate_up_proj")], v.shape[-2] // 2
            for e in range(v.shape[0]):
                swapped[f"{prefix}{e}.gate_proj.weight"] = v[e, :I]
                swapped[f"{prefix}{e}.up_proj.weight"] = v[e, I:]
        elif k.endswith("mlp.experts.down_proj"):
            prefix = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                swapped[f"{prefix}{e}.down_proj.weight"] = v[e]
        elif k.startswith("mtp.") and ".experts." in k:
            continue
        else:
            swapped[k] = v
    E = cfg["num_experts"]
    for proj in ("gate", "up", "down"):
        swapped[f"mtp.layers.0.mlp.experts.{proj}_proj"] = mx.stack(
            [raw[f"mtp.layers.0.mlp.experts.{e}.{proj}_proj.weight"] for e in range(E)]
        )
    gate = swapped.pop("mtp.layers.0.mlp.experts.gate_proj")
    swapped["mtp.layers.0.mlp.experts.gate_up_proj"] = mx.concatenate([gate, swapped.pop("mtp.layers.0.mlp.experts.up_proj")], axis=-2)
    out = write_checkpoint(tmp_path / "swapped", cfg, swapped)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_text((moe_ckpt / f).read_text())
    assert_same(params(moe_ckpt), params(out))


def test_incomplete_experts_and_missing_tensor_errors(tmp_path: Path, dense_ckpt: Path) -> None:
    cfg = json.loads((dense_ckpt / "config.json").read_text())["text_config"]
    raw = random_raw_weights(cfg, seed=3)
    raw.pop("model.language_model.layers.3.mlp.down_proj.weight")
    out = write_checkpoint(tmp_path / "broken", cfg, raw)
    with pytest.raises(CheckpointError, match="lacks 1 tensor.*layers.3.mlp.down_proj.weight"):
        load_shard(out)
    # A shard that does not own layer 3 loads fine: it never needs that tensor.
    assert load_shard(out, ShardSpec(0, 2, TINY_LAYERS)).model.parameter_bytes() > 0


def test_shard_loads_only_its_tensors(dense_ckpt: Path) -> None:
    whole = load_shard(dense_ckpt).model
    parts = [load_shard(dense_ckpt, ShardSpec(a, b, TINY_LAYERS)).model for a, b in ((0, 1), (1, 3), (3, 4))]
    names = [set(dict(tree_flatten(p.parameters()))) for p in parts]
    assert not any(n.startswith(("norm.", "mtp.", "lm_head.")) for n in names[0] | names[1])
    whole_names = dict(tree_flatten(whole.parameters()))
    assert {n for n in names[0] if n.startswith("layers.")} == {n for n in whole_names if n.startswith("layers.0.")}
    # Layer bytes add up to the whole model's; only the embedding is held twice (first + last for MTP).
    embed = whole.embed_tokens.weight.nbytes
    assert sum(p.parameter_bytes() for p in parts) == whole.parameter_bytes() + embed


@pytest.mark.parametrize("mtp_quantized", [True, False])
def test_quantized_checkpoint_loads(dense_ckpt: Path, tmp_path: Path, mtp_quantized: bool) -> None:
    out = convert(dense_ckpt, tmp_path / "q", quantize=True, bits=8, group_size=32, quantize_mtp=mtp_quantized, dtype="float32")
    model = load_shard(out).model
    assert isinstance(model.layers[0].mlp.gate_proj, nn.QuantizedLinear)
    assert isinstance(model.mtp.fc, nn.QuantizedLinear) == mtp_quantized
    x = mx.array([[1, 2, 3]])
    h, _ = model.run_layers(model.embed(x), model.make_cache())
    ref = load_shard(dense_ckpt).model
    hr, _ = ref.run_layers(ref.embed(x), ref.make_cache())
    # 8-bit weights stay close to the float model.
    a, b = model.final_norm(h).reshape(-1), ref.final_norm(hr).reshape(-1)
    cosine = (a * b).sum() / (mx.linalg.norm(a) * mx.linalg.norm(b))
    assert cosine.item() > 0.99
    if mtp_quantized:  # quantizing it again would write a config its weights no longer match
        with pytest.raises(ValueError, match="already quantized"):
            convert(out, tmp_path / "q2", quantize=True)
        (tmp_path / "afile").write_text("")
        with pytest.raises(FileExistsError, match="not an empty directory"):
            convert(dense_ckpt, tmp_path / "afile")


def test_bad_config_errors(tmp_path: Path, dense_ckpt: Path) -> None:
    cfg = json.loads((dense_ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        load_shard(tmp_path)
    with pytest.raises(FileNotFoundError, match="is no directory"):  # (a path that is not there at all)
        convert(tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        load_shard(tmp_path / "empty")


@pytest.mark.parametrize(("bits", "group_size", "mode"), [(4, 64, "affine"), (8, 32, "affine"), (4, 32, "mxfp4"),
                                                          (8, 32, "mxfp8"), (4, 16, "nvfp4")])
def test_packing_is_read_off_the_stored_tensors(bits: int, group_size: int, mode: str) -> None:
    """A layer the config's quantization map does not name: its bits, group size and mode come from its
    packed weight and scales, without mlx-lm's utilities (which import transformers)."""
    from mtpipe.models.loading import packed_quant_config

    linear = nn.Linear(128, 64, bias=False)
    packed = mx.quantize(linear.weight, group_size=group_size, bits=bits, mode=mode)
    weights = {"w.weight": packed[0], "w.scales": packed[1]}
    assert packed_quant_config("w", linear, weights) == {"group_size": group_size, "bits": bits, "mode": mode}
    if mode != "affine":  # uint8 scales allow one (bits, group size) per mode
        weights["w.scales"] = mx.zeros((64, 128 // 8), dtype=mx.uint8)
        with pytest.raises(ValueError, match="no quantization mode"):
            packed_quant_config("w", linear, weights)


def test_rope_settings_are_read_in_either_form() -> None:
    """`rope_parameters` (Qwen3.5's form) or the flat `rope_theta` / `partial_rotary_factor`: either is
    what the model runs with, not mlx-lm's defaults."""
    from mtpipe.models.config import parse_config

    def args(**text):
        return parse_config({"model_type": "qwen3_5", "text_config": {"hidden_size": 64, **text}}).args

    flat = args(rope_theta=1e6, partial_rotary_factor=0.5)
    assert (flat.rope_theta, flat.partial_rotary_factor) == (1e6, 0.5)
    nested = args(rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25},
                  rope_theta=1.0)
    assert (nested.rope_theta, nested.partial_rotary_factor) == (5e6, 0.25)
    assert args().rope_theta == 100000.0
