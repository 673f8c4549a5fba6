"""Published checkpoint formats: each converted model gives its own code's outputs (io.npz) at the reference
README's tolerance, each wrong convention does not, the key mapping is complete on the real-size layouts, and
unfaithful conversions are refused.

The reference set is ``$MEGDIFFUSION_FORMAT_REFERENCE`` or tests/fixtures/ddpm_formats; its models are found
as the directories with a config.json and the weight files beside them, its configs by what the JSON holds.
"""
import collections
import functools
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megdiffusion.compat import quiet_megengine

mge = quiet_megengine()

from megdiffusion import formats, sampling  # noqa: E402
from megdiffusion.files import torch_archive  # noqa: E402
from megdiffusion.formats import convert, diffusers, names, networks  # noqa: E402
from megdiffusion.formats.published import PUBLISHED  # noqa: E402
from megdiffusion.training import checkpoint as ckpt  # noqa: E402
from megdiffusion.training.config import MATHS, NETWORK, TrainConfig, as_flag, build_model  # noqa: E402
from megdiffusion.training.config import names as config_fields  # noqa: E402
from megdiffusion.scripts.cli import config_from_flagfile  # noqa: E402
from megdiffusion.training.trainer import TrainingRun  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

REFERENCE = Path(os.environ.get("MEGDIFFUSION_FORMAT_REFERENCE") or Path(__file__).parent / "fixtures" / "ddpm_formats")
ATOL = 2e-5  # the reference README's: it separates every control listed there, the GroupNorm eps 1e-5 included
CONVENTIONS = {"downsample_padding": ("bottom_right", "symmetric"), "time_embedding": ("ho", "pytorch_ddpm"),
               "norm_eps": (1e-6, 1e-5)}


def _json_holding(key):
    """The reference set's JSON file that has ``key`` at its top level."""
    for path in sorted(REFERENCE.glob("*.json")):
        value = json.loads(path.read_text())
        if key in value:
            return value
    raise AssertionError(f"no JSON file in {REFERENCE} holds {key!r}")


SMALL = _json_holding("inputs")  # the small models' config
FULL_KEYS = _json_holding("models")  # parameter names and shapes of the real-size models
PUBLISHED_CONFIGS = _json_holding("scheduler_config")  # the hub's UNet and scheduler configs
IO = dict(np.load(REFERENCE / "io.npz"))
MODELS = sorted(p for p in REFERENCE.iterdir()
                if (p / "config.json").is_file() or (p.is_file() and p.suffix not in (".json", ".npz", ".md")))


@functools.lru_cache(maxsize=None)
def _converted(path, ema=True, **changes):
    """``convert.convert`` with the small models' sizes; the EMA weights of files that hold two sets."""
    options = dict(dict(image_size=SMALL["inputs"]["sample_size"], norm_groups=SMALL["norm_num_groups"],
                        var_type="fixedlarge"), **changes)
    try:
        return convert.convert(str(path), ema=ema, **options)
    except formats.ConvertError as err:
        if not ema or "holds one set of weights" not in str(err):
            raise
        return convert.convert(str(path), **options)


def _outputs(cfg, weights, x=None, **changes):
    model = build_model(cfg.replace(**changes))
    model.load_state_dict(weights)
    model.eval()
    return model(mge.tensor(IO["x"] if x is None else x), mge.tensor(IO["t"])).numpy()


def _max_error(got, expected):
    return float(np.abs(got - expected).max())


def _model_of_format(name):
    found = [path for path in MODELS if _converted(path)[2]["format"] == name]
    if not found:
        pytest.skip(f"the reference set has no {name} model")
    return found[0]


@pytest.mark.parametrize("path", MODELS, ids=lambda path: path.name)
def test_a_converted_model_gives_its_reference_outputs(path):
    cfg, weights, record = _converted(path)
    assert cfg.num_timesteps == SMALL["inputs"]["num_train_timesteps"] and cfg.image_shape == IO["x"].shape[1:]
    out = _outputs(cfg, weights)
    assert _max_error(out, IO[f"out_{record['format']}"]) < ATOL


def _exportable(path, directory):
    """The converted model at ``path`` as ``megdiffusion.load`` gives it (from a checkpoint in ``directory``)."""
    import megdiffusion

    cfg, weights, record = _converted(path)
    ckpt.save_checkpoint(str(directory / "converted.pkl"), ckpt.weights_snapshot(cfg, weights, record))
    return megdiffusion.load(directory / "converted.pkl")


def _relative(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


EXPORT_RTOL = 1e-4  # test_export's: max |diff| / max |ref|


@pytest.mark.parametrize("path", MODELS, ids=lambda path: path.name)
def test_a_converted_model_exports_to_every_target(path, tmp_path, onnxruntime_out):
    """diffusers bit for bit back (pytorch-ddpm's interleaved embedding reordered there and back), the .mge and
    the ONNX graph to the export tolerance, and all of them still the format's own outputs."""
    import megdiffusion

    model = _exportable(path, tmp_path)
    ours = model(IO["x"], IO["t"])
    model.export(tmp_path / "pipe", "diffusers")
    back = megdiffusion.load(tmp_path / "pipe")
    assert back.config.time_embedding == model.config.time_embedding
    weights, read = model.state_dict(), back.state_dict()
    assert list(weights) == list(read) and all(np.array_equal(weights[k], read[k]) for k in weights)
    model.export(tmp_path / "m.mge", "mge")
    model.export(tmp_path / "m.onnx", "onnx")
    feeds = {"x": IO["x"], "t": np.asarray(model.diffusion.model_timesteps(IO["t"]), np.float32)}
    for out in (megdiffusion.load(tmp_path / "m.mge")(IO["x"], IO["t"]), onnxruntime_out(tmp_path / "m.onnx", feeds)):
        assert _relative(out, ours) <= EXPORT_RTOL
        assert _max_error(out, IO[f"out_{model.source['format']}"]) < ATOL


@pytest.mark.parametrize("path", MODELS, ids=lambda path: path.name)
def test_diffusers_runs_a_converted_models_export_as_its_own_code_does(path, tmp_path, diffusers_run):
    """A published network re-exported to diffusers: DDPMPipeline loads it and gives the format's own outputs."""
    model = _exportable(path, tmp_path)
    model.export(tmp_path / "pipe", "diffusers")
    theirs = diffusers_run(tmp_path / "pipe", x=IO["x"], t=IO["t"], x_T=IO["x"])
    assert _relative(theirs["out"], model(IO["x"], IO["t"])) <= EXPORT_RTOL
    assert _max_error(theirs["out"], IO[f"out_{model.source['format']}"]) < ATOL


@pytest.mark.parametrize("option", CONVENTIONS)
@pytest.mark.parametrize("path", MODELS, ids=lambda path: path.name)
def test_each_wrong_convention_changes_the_outputs_beyond_tolerance(path, option):
    cfg, weights, record = _converted(path)
    wrong = next(value for value in CONVENTIONS[option] if value != getattr(cfg, option))
    assert _max_error(_outputs(cfg, weights, **{option: wrong}), IO[f"out_{record['format']}"]) > ATOL


def test_ema_picks_the_ema_weights_of_a_pytorch_ddpm_checkpoint():
    path = _model_of_format("pytorch_ddpm")
    cfg, weights, record = _converted(path, ema=False)
    assert record["weights"] == "net_model" and _converted(path)[2]["weights"] == "ema_model"
    assert _max_error(_outputs(cfg, weights), IO["neg_pytorch_ddpm_net_model"]) < ATOL


@pytest.mark.parametrize("key, control", [("downsample_padding", "neg_symmetric_pad"),
                                          ("norm_eps", "neg_norm_eps_1e-5")])
def test_a_diffusers_config_without_a_key_means_diffusers_default(tmp_path, key, control):
    source = _model_of_format("diffusers")
    shutil.copytree(source, tmp_path / "model")
    config = json.loads((source / "config.json").read_text())
    del config[key]  # diffusers then uses downsample_padding 1 (symmetric), norm_eps 1e-5
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    cfg, weights, _ = _converted(tmp_path / "model")
    assert _max_error(_outputs(cfg, weights), IO[control]) < ATOL


def test_a_diffusers_config_at_freq_shift_0_is_pytorch_ddpms_embedding_reordered(tmp_path):
    """diffusers' [sin | cos] over i / half is pytorch-ddpm's interleaved embedding with the first time-embedding
    layer's inputs reordered: the same network, as diffusers computed it at freq_shift=0."""
    source = _model_of_format("diffusers")
    shutil.copytree(source, tmp_path / "model")
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "freq_shift": 0}))
    cfg, weights, _ = _converted(tmp_path / "model")
    assert cfg.time_embedding == "pytorch_ddpm"
    assert _max_error(_outputs(cfg, weights), IO["neg_freq_shift_0"]) < ATOL


# --- the MegEngine port: files written the way its code writes them, from the pytorch-ddpm weights -----------

def _ho_table(steps, dim):
    """Ho's sinusoid for t = 0..steps-1: [sin | cos] with frequencies exp(-ln(1e4) i / (dim/2 - 1))."""
    args = np.arange(steps)[:, None] * np.exp(-np.log(10000.0) * np.arange(dim // 2) / (dim // 2 - 1))
    return np.concatenate([np.sin(args), np.cos(args)], axis=1).astype(np.float32)


def _write_port_file(path, ho_table=False, change=None):
    """MegEngine/MegDiffusion's UNet state dict as ``megengine.save`` writes it (a pickle, protocol 4), holding
    the reference pytorch-ddpm EMA weights: the port names the 1x1 skip ``short_cut`` and its convolution biases
    are (1, C, 1, 1). With ``ho_table`` its time table is Ho's sinusoid, as its converter wrote for Ho's weights.
    ``change(state)`` edits the dict before it is written."""
    state = torch_archive.load_torch_file(str(_model_of_format("pytorch_ddpm")))["ema_model"]
    port = collections.OrderedDict()
    for name, array in state.items():
        if name.endswith(".bias") and state[name[:-len("bias")] + "weight"].ndim == 4:
            array = array.reshape(1, -1, 1, 1)
        if name == "time_embedding.timembedding.0.weight" and ho_table:
            array = _ho_table(*array.shape)
        port[name.replace(".shortcut.", ".short_cut.")] = array
    if change is not None:
        change(port)
    path.write_bytes(pickle.dumps(port, protocol=4))
    return path


def test_a_port_file_converted_from_hos_weights_is_hos_network(tmp_path):
    path = _write_port_file(tmp_path / "ddpm_cifar10_ema_converted.pkl", ho_table=True)  # a hub name: RGB
    cfg, weights, record = _converted(path)
    assert record["format"] == "megengine_port" and record["channel_order"] == "rgb"
    assert (cfg.downsample_padding, cfg.time_embedding, cfg.norm_eps) == ("bottom_right", "ho", 1e-6)
    assert _max_error(_outputs(cfg, weights), IO["out_diffusers"]) < ATOL  # the same weights in Ho's network


def test_a_port_trained_bgr_model_becomes_an_rgb_model(tmp_path):
    path = _write_port_file(tmp_path / "ddpm_cifar10_ema.pkl")  # the hub's own CIFAR-10 model: BGR
    cfg, weights, record = _converted(path)
    assert record["channel_order"] == "bgr" and cfg.time_embedding == "pytorch_ddpm"
    # Our RGB model on the RGB image is the port's model on the BGR image, its output reversed back to RGB.
    out = _outputs(cfg, weights, x=IO["x"][:, ::-1])
    assert _max_error(out, IO["out_pytorch_ddpm"][:, ::-1]) < ATOL


def test_the_channel_order_of_a_port_file_is_never_guessed(tmp_path):
    path = _write_port_file(tmp_path / "my_run.pkl")
    with pytest.raises(formats.ConvertError, match="do not record their channel order; give --channel_order"):
        _converted(path)
    expected = IO["out_pytorch_ddpm"][:, ::-1]
    right = _converted(path, channel_order="bgr")
    wrong = _converted(path, channel_order="rgb")
    assert _max_error(_outputs(*right[:2], x=IO["x"][:, ::-1]), expected) < ATOL
    assert _max_error(_outputs(*wrong[:2], x=IO["x"][:, ::-1]), expected) > ATOL
    hub = _write_port_file(tmp_path / "ddpm_cifar10.pkl")
    with pytest.raises(formats.ConvertError, match="the MegEngine port's hub records bgr"):
        _converted(hub, channel_order="rgb")


TIME_TABLE = "time_embedding.timembedding.0.weight"  # the port's sinusoid table, (T, channels)


@pytest.mark.parametrize("change, message", [
    (lambda s: s.pop("tail.2.bias"), r"1 parameters missing: tail\.2\.bias"),
    (lambda s: s.update(extra=np.zeros(3, np.float32)), r"1 tensors left over: extra"),
    (lambda s: s.update({"head.bias": np.zeros(len(s["head.bias"]) + 1, np.float32)}),
     r"head\.bias has shape \(\d+,\)"),
    (lambda s: s.update({"tail.2.weight": np.where(s["tail.2.weight"] > 0.1, np.nan, s["tail.2.weight"])}),
     r"tail\.2\.weight holds NaN"),
    (lambda s: s.update({TIME_TABLE: np.ones_like(s[TIME_TABLE])}),
     r"timembedding\.0\.weight is not a sinusoid"),
])
def test_unfaithful_files_are_refused(tmp_path, change, message):
    path = _write_port_file(tmp_path / "ddpm_cifar10.pkl", change=change)
    with pytest.raises(formats.ConvertError, match=message):
        _converted(path)


def test_wrong_requests_are_refused(tmp_path):
    pesser = _model_of_format("pesser")
    size, groups = SMALL["inputs"]["sample_size"], SMALL["norm_num_groups"]
    with pytest.raises(formats.ConvertError, match="holds one set of weights; --ema picks"):
        convert.convert(str(pesser), ema=True, image_size=size, norm_groups=groups, var_type="fixedlarge")
    with pytest.raises(formats.ConvertError, match="is in the pesser format, not diffusers"):
        _converted(pesser, fmt="diffusers")
    with pytest.raises(formats.ConvertError, match="does not record its image_size .* give --image_size"):
        convert.convert(str(pesser), norm_groups=groups, var_type="fixedlarge")
    with pytest.raises(formats.ConvertError, match=rf"--norm_groups={groups + 1}, but .* states {groups}"):
        _converted(_model_of_format("diffusers"), norm_groups=groups + 1)
    for model in (pesser, _model_of_format("diffusers")):  # Ho's network has one attention head
        with pytest.raises(formats.ConvertError, match=r"--num_heads=4, but .* states 1"):
            _converted(model, num_heads=4)
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps({"w": print}))
    with pytest.raises(formats.ConvertError, match="refusing to load builtins.print"):
        convert.convert(str(evil))


# --- the real-size models: key mapping, network and schedule ------------------------------------------------

@functools.lru_cache(maxsize=1)
def _parameter_shapes(image_size, model_channels, channel_mult, num_res_blocks, attention_resolutions):
    cfg = TrainConfig(image_size=image_size, model_channels=model_channels, channel_mult=channel_mult,
                      num_res_blocks=num_res_blocks, attention_resolutions=attention_resolutions)
    return {name: tuple(value.shape) for name, value in build_model(cfg).state_dict().items()}


@pytest.mark.parametrize("model_id, layout", [(model_id, layout) for model_id, entry in FULL_KEYS["models"].items()
                                               for layout in entry["layouts"]])
def test_the_key_mapping_is_complete_on_the_real_size_layouts(model_id, layout):
    entry = FULL_KEYS["models"][model_id]
    shapes = {name: tuple(shape) for name, shape in entry["layouts"][layout]}
    assert names.detect_layout(shapes) == layout
    if layout.startswith("diffusers"):
        network = diffusers.check_diffusers_config(entry["diffusers_config"])
    else:
        network = networks.network_from_shapes(layout, shapes)
    original = entry["pesser_model_kwargs"]  # the same network in the original code's terms
    size = original["resolution"]
    assert (network["model_channels"], network["channel_mult"], network["num_res_blocks"]) == \
        (original["ch"], tuple(original["ch_mult"]), original["num_res_blocks"])
    attention = tuple(size // 2 ** level for level in network["attention_levels"])
    assert attention == tuple(original["attn_resolutions"])
    [published] = [p for p in PUBLISHED if p.family == "ddpm" and p.channel_mult == network["channel_mult"]]
    assert published.image_size == size and published.attention_levels == network["attention_levels"]

    targets = _parameter_shapes(size, original["ch"], tuple(original["ch_mult"]), original["num_res_blocks"],
                                attention)
    pairs = names.mapping(layout, shapes, targets, len(original["ch_mult"]), original["num_res_blocks"])
    assert sorted(ours for _, ours in pairs) == sorted(targets) and len({theirs for theirs, _ in pairs}) == len(pairs)
    unmapped = set(shapes) - {theirs for theirs, _ in pairs}
    assert unmapped == ({"time_embedding.timembedding.0.weight"} if layout == "pytorch_ddpm" else set())
    mapped = sum(int(np.prod(shapes[theirs])) for theirs, _ in pairs)
    assert mapped + sum(int(np.prod(shapes[name])) for name in unmapped) == entry["num_parameters"][layout]
    if size == 32:
        assert mapped == 35_746_307  # the paper's CIFAR-10 model, and the DDPM recipe's


def _iddpm_source(cfg, extra=()):
    """A ``convert.Source`` holding (zero-stride) tensors of the shapes improved-diffusion's state dict of ``cfg``'s
    network has: conv biases (O,), attention convolutions Conv1d (O, I, 1), q, k and v fused into qkv."""
    shapes = {}
    attention_levels = {level for level in range(len(cfg.channel_mult))
                        if cfg.image_size // 2 ** level in cfg.attention_resolutions}
    for name, shape in _parameter_shapes_of(cfg).items():
        theirs = names.source_name("improved_diffusion", name, len(cfg.channel_mult), cfg.num_res_blocks,
                                     attention_levels)
        is_attention = ".attns." in name or name.startswith("mid_attn.")
        if name.endswith(".bias"):
            shape = (int(np.prod(shape)),)
        elif is_attention and len(shape) == 4:  # 1x1 convolutions there, Conv1d in improved-diffusion
            shape = shape[:3]
        if names.qkv_part("improved_diffusion", name) is not None:
            shape = (3 * shape[0],) + shape[1:]
        shapes[theirs] = shape
    shapes.update(extra)
    tensors = {name: np.broadcast_to(np.float32(0), shape) for name, shape in shapes.items()}
    return convert.Source("model.pt", "improved_diffusion", "improved_diffusion", tensors, {}, "state dict")


def _parameter_shapes_of(cfg):
    return {name: tuple(value.shape) for name, value in build_model(cfg).state_dict().items()}


def test_improved_diffusions_published_cifar10_network_is_the_iddpm_recipe(tmp_path):
    np.savez(tmp_path / "data.npz", arr_0=np.zeros((128, 32, 32, 3), np.uint8))
    recipe, _ = config_from_flagfile(REPO / "configs" / "iddpm_cifar10.cfg", dataset="npz",
                                     data_path=str(tmp_path / "data.npz"))
    source = _iddpm_source(recipe)
    cfg = convert.describe(source)  # no flags: the published network says what the file does not
    for name in config_fields(role=(NETWORK, MATHS)) + ("dropout",):
        assert getattr(cfg, name) == getattr(recipe, name), name
    targets = _parameter_shapes_of(cfg)
    pairs = names.mapping("improved_diffusion", {n: a.shape for n, a in source.tensors.items()}, targets,
                            len(cfg.channel_mult), cfg.num_res_blocks)
    assert sorted(ours for _, ours in pairs) == sorted(targets)
    assert sum(int(np.prod(shape)) for shape in targets.values()) == 52_546_438
    conditional = _iddpm_source(recipe, {"label_emb.weight": (1000, 512)})  # improved-diffusion's class_cond
    assert convert.describe(conditional).num_classes == 1000
    targets = _parameter_shapes_of(convert.describe(conditional))
    pairs = names.mapping("improved_diffusion", {n: a.shape for n, a in conditional.tensors.items()}, targets,
                          len(cfg.channel_mult), cfg.num_res_blocks)
    assert ("label_emb.weight", "class_emb.weight") in pairs and sorted(ours for _, ours in pairs) == sorted(targets)
    assert convert.describe(source, num_heads=2).num_heads == 2  # a flag beats the published value


def _published_configs():
    """(UNet2DModel config, DDPMScheduler config) of each published model family."""
    nested = [value for value in PUBLISHED_CONFIGS.values() if isinstance(value, dict) and "scheduler_config" in value]
    return [(entry["config"], entry["scheduler_config"]) for entry in [PUBLISHED_CONFIGS] + nested]


@pytest.mark.parametrize("unet, scheduler", _published_configs(), ids=lambda c: str(c.get("sample_size", "")))
def test_published_models_record_their_schedule_and_variance(unet, scheduler):
    network, diffusion = diffusers.check_diffusers_config(unet), diffusers.check_scheduler_config(scheduler)
    [published] = [p for p in PUBLISHED if p.family == "ddpm" and p.channel_mult == network["channel_mult"]]
    assert diffusion == {"num_timesteps": 1000, "beta_schedule": "linear", "mean_type": "eps",
                         "var_type": published.var_type}
    assert published.var_type == {32: "fixedlarge", 256: "fixedsmall"}[network["image_size"]]  # Ho et al.
    assert network["downsample_padding"] == "bottom_right" and network["norm_eps"] == 1e-6


@pytest.mark.parametrize("prediction, mean_type", [("epsilon", "eps"), ("sample", "xstart"), ("v_prediction", "v")])
def test_scheduler_predictions_map_to_mean_types(prediction, mean_type):
    config = {**_published_configs()[0][1], "prediction_type": prediction}
    assert diffusers.check_scheduler_config(config)["mean_type"] == mean_type


@pytest.mark.parametrize("change, message", [
    (dict(beta_schedule="scaled_linear"), "the linear and squaredcos_cap_v2 schedules convert"),
    (dict(beta_end=0.01), "are not megdiffusion's linear schedule"),
    (dict(variance_type="learned"), "variance_type='learned'"),  # diffusers' is a variance, ours a log variance
    (dict(prediction_type="flow"), "prediction_type='flow'"),
    (dict(clip_sample=False), "does not clip x_0"),
])
def test_schedules_megdiffusion_does_not_have_are_refused(change, message):
    with pytest.raises(formats.ConvertError, match=message):
        diffusers.check_scheduler_config({**_published_configs()[0][1], **change})


DROP = object()  # a key left out of config.json


@pytest.mark.parametrize("change, message", [
    (dict(flip_sin_to_cos=True), "flip_sin_to_cos=True, freq_shift=1; megdiffusion has"),
    (dict(freq_shift=2), "freq_shift=2"),
    (dict(attention_head_dim=48), "attention_head_dim=48, which does not divide the attended channels"),
    (dict(attention_head_dim=DROP, block_out_channels=[128, 256, 256, 260]), "attention_head_dim=8, which"),
    (dict(act_fn="gelu"), "act_fn='gelu'"),
    (dict(up_block_types=["UpBlock2D"] * 4), "do not mirror down_block_types"),
    (dict(down_block_types=["DownBlock2D", "ResnetDownsampleBlock2D", "DownBlock2D", "DownBlock2D"]),
     "must be 4 DownBlock2D/AttnDownBlock2D"),
    (dict(upcast_attention=True), "keys this converter does not know: upcast_attention"),
    (dict(downsample_padding=2), "downsample_padding=2"),
    (dict(resnet_time_scale_shift="scale_shift"), "attn_norm_num_groups=null: its middle attention has no GroupNorm"),
])
def test_unet_configs_megdiffusion_does_not_compute_are_refused(change, message):
    config = {key: value for key, value in {**_published_configs()[0][0], **change}.items() if value is not DROP}
    with pytest.raises(formats.ConvertError, match=message):
        diffusers.check_diffusers_config(config)


@pytest.mark.parametrize("change, heads", [
    (dict(attention_head_dim=None), dict(num_heads=1, num_head_channels=0)),  # Ho's: one head as wide as the block
    (dict(attention_head_dim=DROP), dict(num_heads=32, num_head_channels=0)),  # diffusers' default 8, all blocks 256
    (dict(attention_head_dim=64, down_block_types=["AttnDownBlock2D"] + ["DownBlock2D"] * 3,
          up_block_types=["UpBlock2D"] * 3 + ["AttnUpBlock2D"]), dict(num_heads=1, num_head_channels=64)),  # 128, 256
])
def test_attention_head_dim_is_channels_per_head(change, heads):
    config = {key: value for key, value in {**_published_configs()[0][0], **change}.items() if value is not DROP}
    network = diffusers.check_diffusers_config(config)
    assert {key: network[key] for key in heads} == heads


# --- the scripts, and runs started from converted weights ---------------------------------------------------

def _run_script(name, *args):
    return subprocess.run([sys.executable, "-m", f"megdiffusion.scripts.{name}", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def _errors(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:") or "Traceback" in line]


def test_convert_writes_a_checkpoint_that_samples(tmp_path):
    source, out = _model_of_format("pytorch_ddpm"), tmp_path / "converted.pkl"
    sizes = [f"--image_size={SMALL['inputs']['sample_size']}", f"--norm_groups={SMALL['norm_num_groups']}"]
    refused = _run_script("convert", source, out, *sizes)
    assert refused.returncode == 2 and _errors(refused.stderr) == [
        f"error: {source} does not record its var_type and is not a published network "
        f"({', '.join(p.name for p in PUBLISHED if p.family == 'ddpm')}); give --var_type"]
    assert not out.exists()

    result = _run_script("convert", source, out, *sizes, "--var_type=fixedsmall", "--ema")
    assert result.returncode == 0, result.stderr
    assert "pytorch_ddpm ema_model" in result.stdout and f"{SMALL['num_parameters']:,} parameters" in result.stdout
    state = ckpt.load_checkpoint(str(out))
    assert state["step"] == 0 and state["optimizer"] is None and state["source"]["weights"] == "ema_model"
    model, diffusion, cfg, step = sampling.load_model(str(out))
    assert cfg.var_type == "fixedsmall" and diffusion.var_type == "fixedsmall"
    out_ = model(mge.tensor(IO["x"]), mge.tensor(IO["t"])).numpy()
    assert _max_error(out_, IO["out_pytorch_ddpm"]) < ATOL

    again = _run_script("convert", source, out, *sizes, "--var_type=fixedsmall")
    assert again.returncode == 2 and _errors(again.stderr) == [
        f"error: OUT {out} exists; give a new path, or --overwrite to replace it"]
    kept = out.read_bytes()
    replaced = _run_script("convert", source, out, *sizes, "--var_type=fixedsmall", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert "pytorch_ddpm net_model" in replaced.stdout and out.read_bytes() != kept  # the raw weights now
    sampled = _run_script("sample", f"--ckpt={out}", f"--output={tmp_path / 'samples'}", "--num_images=2",
                          "--sampler=ddim", "--steps=2", "--batch_size=2")
    assert sampled.returncode == 0, sampled.stderr
    size, channels = SMALL["inputs"]["sample_size"], IO["x"].shape[1]
    assert sampling.read_samples(tmp_path / "samples", 2).shape == (2, size, size, channels)


@pytest.fixture
def converted_checkpoint(tmp_path):
    """A converted pytorch-ddpm checkpoint file, its config and weights."""
    cfg, weights, record = _converted(_model_of_format("pytorch_ddpm"))
    path = tmp_path / "converted.pkl"
    ckpt.save_checkpoint(str(path), ckpt.weights_snapshot(cfg, weights, record))
    return path, cfg, weights


def _images(cfg, count=8):
    size, channels = cfg.image_size, cfg.image_channels
    return np.random.default_rng(0).integers(0, 256, (count, size, size, channels), dtype=np.uint8)


def test_init_from_starts_a_run_from_the_weights(converted_checkpoint, tmp_path):
    path, cfg, weights = converted_checkpoint
    run_cfg = cfg.replace(init_from=str(path), logdir=str(tmp_path / "run"), batch_size=4, total_steps=1,
                          sample_every=0, save_every=0, warmup_steps=0)
    run = TrainingRun(run_cfg, _images(cfg), progress=False)
    assert run.initialise() == 0 and run.trainer.step_count == 0
    with run.trainer.state() as state:
        for model in (state.model, state.ema):
            for name, value in model.state_dict().items():
                np.testing.assert_array_equal(value, weights[name], err_msg=name)
    assert run.run() == 1
    trained = ckpt.load_checkpoint(ckpt.checkpoint_path(run_cfg.logdir, 1))
    assert trained["config"]["init_from"] == str(path) and trained["optimizer"] is not None
    assert not np.array_equal(trained["model"]["conv_in.weight"], weights["conv_in.weight"])

    (tmp_path / "copied" / "checkpoints").mkdir(parents=True)
    shutil.copy(path, ckpt.checkpoint_path(str(tmp_path / "copied"), 0))
    with pytest.raises(ckpt.CheckpointError, match="holds weights only"):  # a converted file does not resume
        TrainingRun(run_cfg.replace(logdir=str(tmp_path / "copied"), resume=True), _images(cfg)).resume()


def test_init_from_a_different_network_is_refused_before_anything_is_written(converted_checkpoint, tmp_path):
    path, cfg, _ = converted_checkpoint
    logdir = tmp_path / "run"
    network = [as_flag(name, getattr(cfg, name)) for name in ckpt.NETWORK_FIELDS
               if name not in ("image_size", "image_channels")]
    np.savez(tmp_path / "data.npz", _images(cfg))
    common = ["--dataset=npz", f"--data_path={tmp_path / 'data.npz'}", f"--init_from={path}", f"--logdir={logdir}",
              "--batch_size=4", "--total_steps=1", "--sample_every=0", "--save_every=0"]
    refused = _run_script("train", *common, *network, "--time_embedding=ho", "--norm_eps=1e-6")
    assert refused.returncode == 2 and _errors(refused.stderr) == [
        f"error: --init_from {path} holds a network with different norm_eps, time_embedding "
        "(--norm_eps=1e-05 --time_embedding=pytorch_ddpm); set those flags"]
    assert not logdir.exists()
    started = _run_script("train", *common, *network)
    assert started.returncode == 0, started.stderr
    assert f"started from the weights of {path} (step 0 of its run)" in started.stdout + started.stderr
    assert [int(p[-11:-4]) for p in ckpt.list_checkpoints(str(logdir))] == [1]
