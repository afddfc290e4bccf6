"""Pretrained weights in and out (vit_pure/weights/, vit_pure/tools/export.py), with the
kit alone: each format's documented layout written and read back, fitting a tree to
another model, the exact GELU, the input scaling, and bad files as one line, exit 2.
tests/test_weights_libs.py checks the same against transformers and timm themselves."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_pmap
from vit_pure import weights
from vit_pure.config import ViTConfig, get_preset
from vit_pure.data.cifar10 import CIFAR10_CLASSES
from vit_pure.errors import WeightsError
from vit_pure.layers.mlp import _gelu
from vit_pure.model import apply, init_params
from vit_pure.run import checkpoint, cli, settings
from vit_pure.step import OptimConfig, make_optimizer, prepare_images, trainable_params
from vit_pure.tools import export
from vit_pure.weights import bigvision, fetch, hf, safetensors, timm, tree
from vit_pure.weights.tree import expected_shapes

# Odd, distinct sizes: 20 wide in 5 heads of 4, 3 layers, MLP 28, 24 px in 8 px patches
# (3x3 grid), 6 classes.
CFG = ViTConfig(name="w", image_size=24, patch_size=8, num_classes=6, width=20, depth=3,
                heads=5, mlp_dim=28)


def random_tree(cfg: ViTConfig, seed=0, zero_cls_row=False) -> dict:
    rng = np.random.default_rng(seed)
    tree = jax.tree.map(lambda s: rng.standard_normal(s).astype(np.float32),
                        expected_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    if zero_cls_row and cfg.class_token:
        tree["pos_embed"][0] = 0
    return tree


def assert_same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


# ------------------------------------------------------------------------- the formats
def test_safetensors_round_trip_and_dtypes(tmp_path):
    a = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "y": np.ones((1, 1, 4), np.float32)}
    safetensors.write(tmp_path / "a.safetensors", a, {"format": "pt"})
    got, meta = safetensors.read(tmp_path / "a.safetensors")
    assert meta == {"format": "pt"} and got.keys() == a.keys()
    for k in a:
        np.testing.assert_array_equal(got[k], a[k])
    # bfloat16 and float16, written by hand from the format's description.
    bf16 = (np.array([1.5, -2.0, 3.25], np.float32).view(np.uint32) >> 16).astype("<u2")
    f16 = np.array([0.5, 7.0], "<f2")
    header = {"b": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
              "h": {"dtype": "F16", "shape": [2], "data_offsets": [6, 10]}}
    text = json.dumps(header).encode()
    (tmp_path / "b.safetensors").write_bytes(len(text).to_bytes(8, "little") + text
                                             + bf16.tobytes() + f16.tobytes())
    got, _ = safetensors.read(tmp_path / "b.safetensors")
    np.testing.assert_array_equal(got["b"], [1.5, -2.0, 3.25])
    np.testing.assert_array_equal(got["h"], [0.5, 7.0])


# The position embedding's three places: vision_transformer / AugReg's (no prefix, and
# under an older Flax optimizer's "opt/target/"), big_vision's top-level one (without the
# class token's row, scanned blocks, "params/"), and a two-tower model's image tower.
BV_LAYOUTS = {
    "augreg": dict(prefix="", numbering="vision_transformer",
                   pos_key="Transformer/posembed_input/pos_embedding", class_row=True),
    "opt-target": dict(prefix="opt/target/", numbering="vision_transformer",
                       pos_key="Transformer/posembed_input/pos_embedding", class_row=True),
    "big_vision-scanned": dict(prefix="params/", numbering="big_vision",
                               pos_key="pos_embedding", class_row=False, scanned=True),
    "big_vision-img-tower": dict(prefix="params/img/", numbering="big_vision",
                                 pos_key="pos_embedding", class_row=True),
}


@pytest.mark.parametrize("layout", list(BV_LAYOUTS))
def test_bigvision_npz_layouts_read_back(layout, tmp_path):
    tree = random_tree(CFG, zero_cls_row=True)
    arrays = bigvision.arrays(tree, CFG.patch_size, CFG.channels, **BV_LAYOUTS[layout])
    # The documented names, e.g. the first block's query kernel (E, H, D).
    a = "1" if BV_LAYOUTS[layout]["numbering"] == "vision_transformer" else "0"
    q = (f"Transformer/encoderblock/MultiHeadDotProductAttention_{a}/query/kernel"
         if BV_LAYOUTS[layout].get("scanned") else
         f"Transformer/encoderblock_0/MultiHeadDotProductAttention_{a}/query/kernel")
    assert arrays[BV_LAYOUTS[layout]["prefix"] + q].shape[-3:] == (20, 5, 4)
    np.savez(tmp_path / "m.npz", **arrays)
    cfg, params = weights.load(tmp_path / "m.npz")
    assert_same_tree(params, tree)
    assert (cfg.width, cfg.depth, cfg.heads, cfg.mlp_dim, cfg.image_size, cfg.patch_size,
            cfg.num_classes, cfg.pool) == (20, 3, 5, 28, 24, 8, 6, "cls")
    assert (cfg.gelu, cfg.ln_eps, cfg.inputs) == ("tanh", 1e-6, "minus1to1")


# timm's documented state-dict names and shapes for CFG (E 20, M 28, K 6, 3x3 + 1 tokens).
TIMM_KEYS = {"patch_embed.proj.weight": (20, 3, 8, 8), "patch_embed.proj.bias": (20,),
             "cls_token": (1, 1, 20), "pos_embed": (1, 10, 20), "norm.weight": (20,),
             "norm.bias": (20,), "head.weight": (6, 20), "head.bias": (6,),
             **{f"blocks.{i}.{k}": s for i in range(3) for k, s in {
                 "norm1.weight": (20,), "norm1.bias": (20,), "norm2.weight": (20,),
                 "norm2.bias": (20,), "attn.qkv.weight": (60, 20), "attn.qkv.bias": (60,),
                 "attn.proj.weight": (20, 20), "attn.proj.bias": (20,),
                 "mlp.fc1.weight": (28, 20), "mlp.fc1.bias": (28,),
                 "mlp.fc2.weight": (20, 28), "mlp.fc2.bias": (20,)}.items()}}


@pytest.mark.parametrize("pool", ["cls", "mean", "gap"])
def test_timm_layout_is_the_documented_one_and_reads_back(pool, tmp_path):
    cfg = CFG.replace(pool=pool, gelu="exact")
    tree = random_tree(cfg)
    timm.write(tmp_path, cfg, tree)
    got, _ = safetensors.read(tmp_path / "model.safetensors")
    want = dict(TIMM_KEYS)
    if pool != "cls":  # timm's average pooling: the LayerNorm after the pool, fc_norm
        want["fc_norm.weight"], want["fc_norm.bias"] = want.pop("norm.weight"), want.pop(
            "norm.bias")
    if pool == "gap":
        del want["cls_token"]
        want["pos_embed"] = (1, 9, 20)
    assert {k: v.shape for k, v in got.items()} == want
    # A torch Linear is (out, in): q, k, v are the rows of qkv, each (heads, head dim).
    np.testing.assert_array_equal(got["blocks.1.attn.qkv.weight"][20:40],
                                  tree["blocks"]["attn"]["qkv"]["kernel"][1][:, 1]
                                  .reshape(20, 20).T)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_args"]["num_heads"] == 5
    (tmp_path / "config.json").unlink()  # the weights alone: heads from the caller
    cfg2, params = weights.load(tmp_path / "model.safetensors", heads=5)
    assert_same_tree(params, tree)
    assert (cfg2.pool, cfg2.gelu, cfg2.ln_eps) == (pool, "exact", 1e-6)


def test_hf_folder_round_trip(tmp_path):
    cfg = CFG.replace(gelu="exact", ln_eps=1e-12, inputs="imagenet")
    tree = random_tree(cfg)
    weights.save(tmp_path, cfg, tree, "hf")
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["num_attention_heads"], config["hidden_act"], config["layer_norm_eps"]) \
        == (5, "gelu", 1e-12)
    assert weights.detect(tmp_path) == "hf" == weights.detect(tmp_path / "model.safetensors")
    cfg2, params = weights.load(tmp_path)
    assert_same_tree(params, tree)
    assert cfg2.replace(name="w") == cfg
    # transformers 5's key names are read too.
    w, meta = safetensors.read(tmp_path / "model.safetensors")
    renamed = {k.replace("encoder.layer.", "layers.").replace(
        "attention.attention.query", "attention.q_proj").replace(
        "intermediate.dense", "mlp.fc1"): v for k, v in w.items()}
    safetensors.write(tmp_path / "model.safetensors", renamed, meta)
    assert_same_tree(weights.load(tmp_path)[1], tree)
    with pytest.raises(WeightsError, match="pool 'gap'"):
        hf.write(tmp_path / "x", cfg.replace(pool="gap"), tree)


def test_export_of_a_checkpoint_imports_back_unchanged(tmp_path, capsys):
    cfg = get_preset("tiny")
    tree = random_tree(cfg)
    meta = {"model_config": json.loads(json.dumps(cfg.__dict__))}
    checkpoint.save(tmp_path / "ckpt", 7, {"params": tree, "step": 7}, meta)
    for fmt in ("hf", "timm"):
        assert export.main([str(tmp_path / "ckpt"), "--to", fmt, str(tmp_path / fmt)]) == 0
        cfg2, params = weights.load(tmp_path / fmt / "model.safetensors", heads=None)
        assert_same_tree(params, tree)
        assert cfg2.replace(name="tiny", dropout=0.1, drop_path=0.1,
                            inputs="cifar10", ln_eps=cfg.ln_eps) == cfg, fmt
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["hidden_act"] \
        == "gelu_pytorch_tanh"  # the tiny preset's tanh GELU, said to transformers
    assert export.main([str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "e"),
                        "--ema"]) == 2
    assert "no ema" in capsys.readouterr().err


_logits = jax.jit(apply, static_argnums=2)  # one compile per config, shared by the cases


@pytest.mark.parametrize("fmt", ["timm", "hf"])
@pytest.mark.parametrize("gelu", ["tanh", "exact"])
def test_export_then_import_is_the_identity_in_logits(fmt, gelu, tmp_path):
    """Export the kit's model, import the files with the kit (timm and transformers are
    not needed): the same model config (the GELU and input scaling included) and the same
    logits, bit for bit."""
    cfg = CFG.replace(gelu=gelu, inputs="imagenet")
    tree = random_tree(cfg)
    weights.save(tmp_path / fmt, cfg, tree, fmt)
    cfg2, params = weights.load(tmp_path / fmt / "model.safetensors", heads=cfg.heads)
    assert cfg2.replace(name=cfg.name) == cfg
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 24, 24, 3)), jnp.float32)
    want = _logits(jax.tree.map(jnp.asarray, tree), x, cfg)
    got = _logits(jax.tree.map(jnp.asarray, params), x, cfg2)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_timm_act_layer_is_read_and_an_unknown_one_refused(tmp_path):
    timm.write(tmp_path, CFG.replace(gelu="tanh"), random_tree(CFG))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_args"]["act_layer"] == "gelu_tanh"
    config["model_args"]["act_layer"] = "quick_gelu"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match="act_layer 'quick_gelu' is none of the GELUs"):
        weights.load(tmp_path / "model.safetensors")


def test_hf_export_names_cifar10s_classes(tmp_path):
    weights.save(tmp_path / "ten", CFG.replace(num_classes=10),
                 random_tree(CFG.replace(num_classes=10)), "hf")
    config = json.loads((tmp_path / "ten" / "config.json").read_text())
    assert list(config["id2label"].values()) == list(CIFAR10_CLASSES)
    assert config["label2id"]["truck"] == 9 and config["id2label"]["0"] == "airplane"
    weights.save(tmp_path / "six", CFG, random_tree(CFG), "hf")  # not CIFAR-10's head
    assert json.loads((tmp_path / "six" / "config.json").read_text())["id2label"]["5"] \
        == "LABEL_5"


def test_a_dinov2_shaped_model_exports_as_dinov2_and_imports_back_unchanged(tmp_path):
    """Pool cls+mean with a layer scale: a Dinov2ForImageClassification, the layer scale
    kept as transformers' lambda1, read back by the importer as it was written."""
    cfg = CFG.replace(pool="cls+mean", layer_scale=1e-5, gelu="exact", inputs="imagenet",
                      mlp_dim=60)
    tree = random_tree(cfg)
    weights.save(tmp_path, cfg, tree, "hf")
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == \
        ("dinov2", ["Dinov2ForImageClassification"])
    assert config["mlp_ratio"] == 3 and "intermediate_size" not in config
    w, _ = safetensors.read(tmp_path / "model.safetensors")
    np.testing.assert_array_equal(w["dinov2.encoder.layer.1.layer_scale2.lambda1"],
                                  tree["blocks"]["ls2"]["gamma"][1])
    assert w["classifier.weight"].shape == (6, 40) and not w["dinov2.embeddings.mask_token"].any()
    cfg2, params = weights.load(tmp_path)
    assert_same_tree(params, tree)
    assert (cfg2.pool, cfg2.inputs, cfg2.gelu, cfg2.layer_scale is not None) == \
        ("cls+mean", "imagenet", "exact", True)
    with pytest.raises(WeightsError, match="MLP is a whole multiple of the width"):
        hf.write(tmp_path / "x", cfg.replace(mlp_dim=28), tree)  # DINOv2's mlp_ratio: 1.4


def test_bfloat16_safetensors_round_to_nearest_even_and_read_back(tmp_path):
    """`write(..., dtype="BF16")`: each float32 rounded to the nearest bfloat16, ties to the
    even one, as ml_dtypes (JAX's bfloat16) rounds; NaN stays NaN, past the largest
    bfloat16 is infinity; `read` widens them back exactly."""
    import ml_dtypes

    ulp = 2.0 ** -7  # bfloat16's spacing in [1, 2)
    edges = np.array([1.0, 1 + ulp / 2, 1 + 1.5 * ulp, 1 + ulp / 2 + 2 ** -20, -(1 + ulp / 2),
                      3.4e38, np.inf, -np.inf, 1e-40, -0.0, np.pi], np.float32)
    values = np.concatenate([edges, np.random.default_rng(0).standard_normal(1000)
                             .astype(np.float32) * 10.0 ** np.arange(-20, 20, 0.04)[:1000]])
    path = tmp_path / "bf16.safetensors"
    safetensors.write(path, {"v": values, "nan": np.array([np.nan], np.float32)}, dtype="BF16")
    got, _ = safetensors.read(path)
    header, _ = safetensors.read_header(path)
    assert {header[k]["dtype"] for k in ("v", "nan")} == {"BF16"}
    want = values.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(got["v"], want)
    assert list(got["v"][:3]) == [1.0, 1.0, 1 + 2 * ulp]  # ties to even, both ways
    assert got["v"][3] == 1 + ulp and got["v"][5] == np.inf and np.isnan(got["nan"][0])
    assert path.stat().st_size < 2 * values.size + 300  # two bytes a value
    with pytest.raises(WeightsError, match="BF16"):
        safetensors.write(tmp_path / "x", {"v": values}, dtype="F16")


def test_a_dinov2_backbone_file_exports_as_a_bfloat16_dinov2_folder(tmp_path, capsys):
    """A weights file with a layer scale and no head (DINOv2's backbone, as its ONNX is):
    `export FILE --to hf DIR --dtype bf16` writes a transformers DINOv2 model without a
    classifier (the layer scale kept, not folded as transformers' ViT would need), its
    tensors in bfloat16, which `--init-from` reads back as the file's weights rounded."""
    import ml_dtypes

    cfg = CFG.replace(layer_scale=0.5, gelu="exact", inputs="imagenet", mlp_dim=40)
    tree = random_tree(cfg)
    del tree["head"]
    timm.write(tmp_path / "src", cfg, {**tree, "head": random_tree(cfg)["head"]})
    w, _ = safetensors.read(tmp_path / "src" / "model.safetensors")
    safetensors.write(tmp_path / "src" / "model.safetensors",
                      {k: v for k, v in w.items() if not k.startswith("head.")})
    source = str(tmp_path / "src" / "model.safetensors")
    assert export.main([source, "--to", "hf", str(tmp_path / "hf"), "--dtype", "bf16"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "dinov2" and config["id2label"] == {}
    w, _ = safetensors.read(tmp_path / "hf" / "model.safetensors")
    header, _ = safetensors.read_header(tmp_path / "hf" / "model.safetensors")
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    assert not any(k.startswith("classifier") for k in w)
    cfg2, params = weights.load(tmp_path / "hf")
    assert (cfg2.layer_scale, cfg2.num_classes, cfg2.gelu) == (1.0, 0, "exact")
    rounded = jax.tree.map(lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)
                           .astype(np.float32), tree)
    assert_same_tree(params, rounded)
    assert export.main([source, "--to", "timm", str(tmp_path / "t"), "--dtype", "bf16"]) == 2
    assert export.main([source, "--to", "hf", str(tmp_path / "e"), "--ema"]) == 2
    err = capsys.readouterr().err
    assert "only --to hf writes another dtype" in err and "only a checkpoint holds an EMA" in err


# ----------------------------------------------------------------- fitting to the model
def test_fit_resamples_the_position_embedding_and_puts_in_a_zero_head():
    src = CFG.replace(image_size=48)  # a 6x6 grid, 6 classes
    tree = random_tree(src)
    cfg = CFG.replace(num_classes=10)  # 3x3 grid, 10 classes
    params, notes = weights.fit(tree, src, cfg, "f")
    assert params["pos_embed"].shape == (10, 20)
    np.testing.assert_array_equal(params["pos_embed"][0], tree["pos_embed"][0])  # class row
    grid = jax.image.resize(tree["pos_embed"][1:].reshape(6, 6, 20), (3, 3, 20), "bilinear")
    np.testing.assert_allclose(params["pos_embed"][1:], np.asarray(grid).reshape(9, 20),
                               rtol=1e-6)
    assert not params["head"]["kernel"].any() and params["head"]["kernel"].shape == (20, 10)
    assert notes == ["position embedding resampled from 6x6 to 3x3 patches (bilinear)",
                     "new head: 10 classes, zero-initialised (the file's 6)"]
    same, notes = weights.fit(tree, src, src, "f")  # the file's own model: unchanged
    assert_same_tree(same, tree)
    assert notes == []


@pytest.mark.parametrize("change, message", [
    (dict(width=24, heads=6), "blocks/attn/out/bias is (3, 20) in the file; w needs (3, 24)"),
    (dict(mlp_dim=32), "blocks/mlp/fc1/bias is (3, 28) in the file; w needs (3, 32)"),
    (dict(depth=4), "blocks/attn/out/bias is (3, 20) in the file; w needs (4, 20)"),
    (dict(pool="gap"), "has class token; --pool gap needs none"),
])
def test_a_file_that_does_not_fit_is_one_line_naming_key_and_shapes(change, message):
    with pytest.raises(WeightsError) as e:
        weights.fit(random_tree(CFG), CFG, CFG.replace(**change), "f")
    assert message in one_line(e)


# ------------------------------------------------------------------- the model's details
def test_exact_gelu_and_its_gradient():
    @jax.jit  # one program, not one per operation
    def values(x):
        def exact(x):
            return _gelu(x, None, jnp.float32, True).sum()

        def ref(x):
            return jax.nn.gelu(x, approximate=False).sum()
        return (_gelu(x, None, jnp.float32, True), jax.nn.gelu(x, approximate=False),
                jax.grad(exact)(x), jax.grad(ref)(x), _gelu(x, None, jnp.float32, False))

    gelu, ref, grad, ref_grad, tanh = values(jnp.linspace(-5.0, 5.0, 41))
    np.testing.assert_allclose(gelu, ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(tanh - gelu)).max() > 1e-4  # not the tanh form


@pytest.mark.parametrize("inputs, low, high", [("minus1to1", -1.0, 1.0),
                                               ("imagenet", -0.485 / 0.229, 0.515 / 0.229)])
def test_input_scaling_is_applied_by_the_pipeline(inputs, low, high):
    x = np.zeros((1, 2, 2, 3), np.uint8)
    x[0, 1] = 255
    out = np.asarray(prepare_images(x, None, None, train=False, image_size=2, inputs=inputs))
    np.testing.assert_allclose(out[0, 0, :, 0], low, rtol=1e-6)
    np.testing.assert_allclose(out[0, 1, :, 0], high, rtol=1e-6)


# ------------------------------------------------------------- bad input: one line, exit 2
def _write_bad(tmp_path, kind):
    p = tmp_path / "bad"
    if kind == "garbage":
        p.write_bytes(b"\x00garbage" * 10)
    elif kind == "truncated":
        tree = random_tree(CFG)
        timm.write(tmp_path / "t", CFG, tree)
        data = (tmp_path / "t" / "model.safetensors").read_bytes()
        p.write_bytes(data[:len(data) // 2])
    elif kind == "npz-not-vit":
        np.savez(tmp_path / "bad.npz", foo=np.zeros(3))
        p = tmp_path / "bad.npz"
    elif kind == "wrong-shape":  # a 20-wide model for --model tiny (24 wide)
        np.savez(tmp_path / "w.npz", **bigvision.arrays(random_tree(CFG), 8, 3))
        p = tmp_path / "w.npz"
    elif kind == "missing":
        p = tmp_path / "nothing-here.npz"
    return p


@pytest.mark.parametrize("kind, message", [
    ("garbage", "not a safetensors file"), ("truncated", "do not fit shape"),
    ("npz-not-vit", "no embedding/kernel"), ("missing", "no such file"),
    ("wrong-shape", "needs (4, 24)"),
])
def test_bad_weights_file_is_one_line_and_exit_2(kind, message, tmp_path, capsys):
    path = _write_bad(tmp_path, kind)
    try:  # a missing file is refused by the parser (SystemExit), the rest by the reader
        code = cli.main_guard(lambda: train_pmap.main(
            ["--model", "tiny", "--dataset", "synthetic", "--init-from", str(path)]))
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert "error: --init-from" in err, err  # which flag gave the file


def test_a_url_is_fetched_into_the_cache_and_offline_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    src = tmp_path / "m.npz"
    np.savez(src, **bigvision.arrays(random_tree(CFG), 8, 3))
    local = weights.resolve(src.as_uri(), log=lambda line: None)
    assert local.read_bytes() == src.read_bytes() and str(tmp_path / "cache") in str(local)
    src.unlink()  # the second time it comes from the cache
    assert weights.resolve(src.as_uri(), log=lambda line: None) == local
    with pytest.raises(WeightsError) as e:  # nothing listens on port 9 of this machine
        weights.resolve("http://127.0.0.1:9/ViT-B_16.npz", log=lambda line: None)
    assert "cannot fetch http://127.0.0.1:9/ViT-B_16.npz" in one_line(e)
    # The failed fetch leaves no folder behind; the cache keeps the one that worked.
    assert [p for p in (tmp_path / "cache").iterdir()] == [local.parent]
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "new" / "cache"))
    with pytest.raises(WeightsError):
        weights.resolve("http://127.0.0.1:9/ViT-B_16.npz", log=lambda line: None)
    assert not (tmp_path / "new").exists()


def test_finetune_recipe_needs_init_from_and_sets_sgd(capsys):
    code = cli.main_guard(lambda: train_pmap.main(["--recipe", "finetune-b16",
                                                   "--dataset", "synthetic"]))
    assert code == 2 and "give --init-from" in capsys.readouterr().err
    r = cli.RECIPES["finetune-b16"]
    assert (r["optimizer"], r["batch"], r["lr"], r["grad_clip"], r["model"]) == \
        ("sgd", 512, 0.03, 1.0, "vit-b16")
    assert math.isclose(r["weight_decay"], 0.0)


# ------------------------------------------------- every array placed, or named and refused
def _with_extra(tmp_path, fmt):
    """A file of each reader's format with one array the kit has no place for."""
    tree = random_tree(CFG.replace(gelu="exact"), zero_cls_row=True)
    if fmt == "bigvision":
        arrays = bigvision.arrays(tree, 8, 3)
        arrays["Transformer/encoderblock_0/LayerScale_0/scale"] = np.ones(20, np.float32)
        np.savez(tmp_path / "m.npz", **arrays)
        return tmp_path / "m.npz", "Transformer/encoderblock_0/LayerScale_0/scale (20,)"
    weights.save(tmp_path, CFG.replace(gelu="exact"), tree, fmt)
    path = tmp_path / "model.safetensors"
    arrays, _ = safetensors.read(path)
    arrays["blocks.0.attn.q_norm.weight" if fmt == "timm" else "vit.encoder.layer.0.x"] = \
        np.ones(4, np.float32)
    safetensors.write(path, arrays)
    return path, "q_norm.weight (4,)" if fmt == "timm" else "vit.encoder.layer.0.x (4,)"


@pytest.mark.parametrize("fmt", ["bigvision", "timm", "hf"])
def test_every_reader_refuses_an_array_it_has_no_place_for_naming_it(fmt, tmp_path):
    path, named = _with_extra(tmp_path, fmt)
    with pytest.raises(WeightsError) as e:
        weights.load(path, heads=5)
    assert named in one_line(e) and "1 array(s)" in one_line(e)


def test_position_embedding_resampled_as_each_library_does():
    """big_vision: scipy.ndimage.zoom, order 1 (corners aligned; scipy is JAX's own
    dependency); timm's and transformers' bicubic are checked against torch in
    tests/test_weights_libs.py."""
    ndimage = pytest.importorskip("scipy.ndimage")
    grid = np.random.default_rng(0).standard_normal((4, 4, 5)).astype(np.float32)
    for side in (8, 16, 3, 2):
        got = tree.resample_grid(grid, side, "bigvision")
        ref = ndimage.zoom(grid, (side / 4, side / 4, 1), order=1)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    # An .npz at 24 px fitted to 48 px: big_vision's resampling, said so.
    src = CFG.replace(name="src")
    params, notes = weights.fit(random_tree(src), src, CFG.replace(image_size=48), "f",
                                "bigvision")
    ref = ndimage.zoom(random_tree(src)["pos_embed"][1:].reshape(3, 3, 20), (2, 2, 1),
                       order=1)
    np.testing.assert_allclose(params["pos_embed"][1:].reshape(6, 6, 20), ref, rtol=1e-5,
                               atol=1e-6)
    assert "corners aligned" in notes[0]


def test_bigvision_pre_2022_layout_and_bfloat16_arrays_read(tmp_path):
    """The position embedding in the encoder (Transformer/pos_embedding, class row
    included) and every array in bfloat16, as JAX saves it (numpy records "V2")."""
    ml_dtypes = pytest.importorskip("ml_dtypes")  # JAX's own dependency
    src = random_tree(CFG, zero_cls_row=True)
    arrays = bigvision.arrays(src, 8, 3, pos_key="Transformer/pos_embedding")
    np.savez(tmp_path / "m.npz", **{k: v.astype(ml_dtypes.bfloat16) for k, v in arrays.items()})
    cfg, params = weights.load(tmp_path / "m.npz")
    rounded = jax.tree.map(lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32), src)
    assert_same_tree(params, rounded)
    assert cfg.image_size == 24


@pytest.mark.parametrize("kind, message", [
    ("pool-0", 'or "0" (the first patch token)'),
    ("sincos2d", 'posemb "sincos2d" is computed, not stored'),
    ("truncated-npz", "a damaged or truncated .npz"),
])
def test_npz_messages_say_what_is_wrong(kind, message, tmp_path):
    arrays = bigvision.arrays(random_tree(CFG, zero_cls_row=True), 8, 3)
    path = tmp_path / "m.npz"
    if kind == "pool-0":  # big_vision's pool_type "0": no class token
        del arrays["cls"]
    elif kind == "sincos2d":  # a fixed embedding: no array
        del arrays["Transformer/posembed_input/pos_embedding"]
    np.savez(path, **arrays)
    if kind == "truncated-npz":
        path.write_bytes(path.read_bytes()[:3000])
    with pytest.raises(WeightsError) as e:
        weights.load(path)
    assert message in one_line(e)


# ----------------------------------------------- the model the file describes, and export
LS_CFG = CFG.replace(name="ls", gelu="exact", layer_scale=0.5, registers=2)


def test_layer_scale_and_registers_round_trip_through_timm_and_fold_into_hf(tmp_path):
    tree = random_tree(LS_CFG)
    weights.save(tmp_path / "timm", LS_CFG, tree, "timm")
    cfg, params = weights.load(tmp_path / "timm" / "model.safetensors", heads=5)
    assert (cfg.layer_scale, cfg.registers, cfg.patch_size) == (1.0, 2, 8)
    assert_same_tree(params, tree)
    # transformers' ViT has no layer scale: folded into the projections, the same function.
    no_reg = LS_CFG.replace(registers=0)
    tree = random_tree(no_reg)
    weights.save(tmp_path / "hf", no_reg, tree, "hf")
    cfg, params = weights.load(tmp_path / "hf")
    assert cfg.layer_scale is None
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 24, 24, 3)), jnp.float32)
    np.testing.assert_allclose(apply(params, x, cfg), apply(tree, x, no_reg), rtol=2e-5,
                               atol=2e-5)


@pytest.mark.slow
def test_patch_size_layer_scale_and_registers_come_from_the_file(tmp_path, capsys):
    """--model tiny has 8 px patches, no layer scale, no registers; the file has 4 px
    patches (an 8x8 grid at 32 px), layer scale and 3 registers: one step trains it."""
    model = get_preset("tiny").replace(patch_size=4, layer_scale=0.1, registers=3,
                                       gelu="exact")
    weights.save(tmp_path, model, jax.tree.map(np.asarray, init_params(
        jax.random.key(0), model)), "timm")
    # A small synthetic set (its default is CIFAR-10's 45,000 + 5,000 + 10,000 images,
    # evaluated at the end 8 at a time) and no RandAugment (it doubles the step's compile
    # time): the claim is what the run takes from the file, and the final evaluation
    # still runs the imported model.
    code = cli.main_guard(lambda: train_pmap.main(
        ["--model", "tiny", "--dataset", "synthetic", "--synthetic-train", "64",
         "--synthetic-val", "16", "--synthetic-test", "16", "--randaugment", "0",
         "--init-from", str(tmp_path / "model.safetensors"), "--steps", "1", "--batch", "8",
         "--eval-every", "0"]))
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "32 px in 4 px patches" in out.out and "layer scale, 3 registers" in out.out


# ------------------------------------------------------------------- a linear probe
def test_trainable_head_differentiates_and_updates_the_head_alone():
    """--trainable head: the backbone's gradients are zeros autodiff never computes
    (stop_gradient), and its updates zeros too, weight decay included."""
    cfg = CFG.replace(pool="cls+mean", layer_scale=0.5)
    params = init_params(jax.random.key(0), cfg)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 24, 24, 3)), jnp.float32)

    def loss(p):
        return jnp.sum(apply(trainable_params(p, "head"), x, cfg) ** 2)
    grads = jax.jit(jax.grad(loss))(params)
    assert all(not np.any(g) for k, v in grads.items() if k != "head"
               for g in jax.tree.leaves(v))
    assert np.any(grads["head"]["kernel"]) and grads["head"]["kernel"].shape == (40, 6)
    optimizer, _ = make_optimizer(OptimConfig(trainable="head", weight_decay=0.1,
                                              warmup_steps=0), 10)
    updates = jax.jit(lambda p: optimizer.update(
        jax.tree.map(jnp.ones_like, p), optimizer.init(p), p)[0])(params)
    for k, v in updates.items():
        assert all(np.any(u) == (k == "head") for u in jax.tree.leaves(v)), k


def test_dinov2_recipe_needs_init_from(capsys):
    code = cli.main_guard(lambda: train_pmap.main(["--recipe", "finetune-dinov2-s14",
                                                   "--data-dir", "/nonexistent"]))
    assert code == 2 and "give --init-from" in capsys.readouterr().err
    r = cli.RECIPES["finetune-dinov2-s14"]
    assert (r["trainable"], r["pool"], r["image_size"]) == ("head", "cls+mean", 112)


def test_dinov2_gpu_recipe_needs_init_from_and_fine_tunes_everything(capsys):
    # (CIFAR-10, since the recipe sets --val-fraction: the refusal comes before any read)
    code = cli.main_guard(lambda: train_pmap.main(["--recipe", "finetune-dinov2-s14-gpu",
                                                   "--data-dir", "/nonexistent"]))
    assert code == 2 and "give --init-from" in capsys.readouterr().err
    args = cli.parse_args(cli.build_parser("test"), ["--recipe", "finetune-dinov2-s14-gpu"])
    optim = settings.RunConfig.from_args(args).schedule.optim
    assert (optim.trainable, optim.optimizer, optim.layer_decay) == ("all", "adamw", 0.65)
    assert (args.image_size, args.cfg.pool, args.cfg.drop_path, args.eval_flip) == \
        (252, "cls+mean", 0.1, True)
    assert (args.val_fraction, args.eval_corners, args.mixup, args.ema) == (0.0, True, 0.8, 0.998)
