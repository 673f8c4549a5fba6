"""TrainConfig: every ConfigError, the bounds and choices on the fields, and the flags made from them."""
import dataclasses

import numpy as np
import pytest
from absl import flags

from megdiffusion.scripts import cli
from megdiffusion.data.datasets import DATASETS
from megdiffusion.diffusion.choices import LOSS_TYPES, MEAN_TYPES, SAMPLERS, VAR_TYPES
from megdiffusion.diffusion.schedules import SCHEDULES
from megdiffusion.nn.options import DOWNSAMPLE_PADDINGS, TIME_EMBEDDINGS
from megdiffusion.training import config
from megdiffusion.training.config import ConfigError, TrainConfig


@pytest.mark.parametrize("changes, message", [
    (dict(device="tpu"), "--device must be one of auto, cpu, gpu, got 'tpu'"),
    (dict(lr=0.0), "--lr must be > 0, got 0.0"),
    (dict(image_size=None), "--image_size is unset"),
    (dict(num_gpus=2, world_size=1), "--world_size 1 is smaller than --num_gpus 2"),
    (dict(batch_size=6, world_size=4), "--batch_size: global batch size 6 is not divisible by world size 4"),
    (dict(channel_mult=(1, 2), image_size=9), "bad model flags: image_size=9 must be divisible by"),
    (dict(num_timesteps=20), "bad diffusion flags: the linear schedule needs num_timesteps > 20"),
    (dict(sample_every=10, sample_steps=41),
     "--sample_sampler/--sample_steps/--sample_spacing/--sample_order: steps must be an integer between 1 and T=40"),
    (dict(loss_type="hybrid"), "bad diffusion flags: loss_type 'hybrid' weights the vb term that trains a learned "
                               "variance; var_type 'fixedlarge' learns none"),
    (dict(num_heads=3), "bad model flags: attention over 32 channels cannot be split into heads with num_heads=3"),
    (dict(num_head_channels=12), "bad model flags: attention over 32 channels cannot be split into heads with "
                                 "num_head_channels=12"),
])
def test_validate_names_the_flag_to_change(tiny_config, changes, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        config.validate(tiny_config(**changes))


def test_the_tiny_config_is_valid(tiny_config):
    config.validate(tiny_config())


def bounded_fields():
    return [f for f in dataclasses.fields(TrainConfig) if config.rule(f.metadata)]


def test_every_bound_is_checked_and_inclusive_bounds_pass(tiny_config):
    assert {f.name for f in bounded_fields()} >= {"lr", "ema_decay", "dropout", "batch_size", "port"}
    for f in bounded_fields():
        step = 0.5 if f.type is float else 1
        meta = f.metadata
        outside = [meta["min"] - step] if "min" in meta else [meta["above"]] if "above" in meta else []
        outside += [meta["max"] + step] if "max" in meta else [meta["below"]] if "below" in meta else []
        for value in outside:
            with pytest.raises(ConfigError, match=f"^--{f.name} must be {config.rule(f.metadata)}, got"):
                config.validate(tiny_config(**{f.name: value}))
        for value in [meta[key] for key in ("min", "max") if key in meta]:
            config.check_field(f, value)


@pytest.mark.parametrize("name, choices", [("dataset", DATASETS), ("beta_schedule", SCHEDULES),
                                           ("mean_type", MEAN_TYPES), ("var_type", VAR_TYPES),
                                           ("loss_type", LOSS_TYPES), ("sample_sampler", SAMPLERS),
                                           ("downsample_padding", DOWNSAMPLE_PADDINGS),
                                           ("time_embedding", TIME_EMBEDDINGS)])
def test_choices_come_from_the_code_that_implements_them(tiny_config, name, choices):
    field = next(f for f in dataclasses.fields(TrainConfig) if f.name == name)
    assert field.metadata["choices"] == choices
    for choice in choices:  # each builds a diffusion and passes the sampler check (hybrid: with a learned variance)
        config.validate(tiny_config(**{"var_type": "learned_range", name: choice}, sample_every=10, sample_steps=4))
    with pytest.raises(ConfigError, match=f"--{name} must be one of"):
        config.validate(tiny_config(**{name: "nope"}))


def test_flags_list_the_choices_and_bounds():
    flag_values = flags.FlagValues()
    config.define_flags(flag_values)
    assert "<fashion_mnist|cifar10|folder|npz|prepared>" in flag_values["dataset"].help
    assert flag_values["ema_decay"].help.endswith("Must be >= 0 and < 1.")
    assert "<fixedlarge|fixedsmall|learned_range|learned>" in flag_values["var_type"].help
    assert "<mse|hybrid>" in flag_values["loss_type"].help and "<ho|pytorch_ddpm|iddpm>" in \
        flag_values["time_embedding"].help
    with pytest.raises(flags.IllegalFlagValueError, match="should be one of <ddpm|ddim|euler|heun|"):
        flag_values(["train", "--sample_sampler=bogus"])
    with pytest.raises(flags.IllegalFlagValueError, match="should be one of <leading|linspace|trailing|karras|logsnr>"):
        flag_values(["train", "--sample_spacing=uniform"])


def test_list_flags_need_integers():
    flag_values = flags.FlagValues()
    config.define_flags(flag_values)
    flag_values(["train", "--channel_mult=1,two"])
    with pytest.raises(ConfigError, match="--channel_mult needs comma-separated integers, got 1,two"):
        config.config_from_flags(flag_values)


def test_unknown_checkpoint_keys():
    values = TrainConfig().to_dict()
    assert TrainConfig.from_dict(values) == TrainConfig()
    with pytest.raises(ConfigError, match=r"unknown config keys \['learning_rate'\]"):
        TrainConfig.from_dict({**values, "learning_rate": 1.0})


def test_a_stored_config_without_a_later_field_means_what_it_meant_then():
    values = TrainConfig().to_dict()
    assert TrainConfig().downsample_padding == "bottom_right"  # new models: Ho's padding
    del values["downsample_padding"], values["time_embedding"], values["norm_eps"]
    improved = ("use_scale_shift_norm", "num_heads", "num_head_channels", "loss_type", "rescale_timesteps")
    for name in improved:
        del values[name]
    old = TrainConfig.from_dict(values)  # a checkpoint written before these fields existed
    assert (old.downsample_padding, old.time_embedding, old.norm_eps) == ("symmetric", "ho", 1e-6)
    assert [getattr(old, name) for name in improved] == [False, 1, 0, "mse", False]  # Ho's network and loss
    assert TrainConfig.from_dict(TrainConfig(downsample_padding="symmetric").to_dict()).downsample_padding == \
        "symmetric"


def test_resolve_checks_the_data(tiny_config, tmp_path):
    wide = tmp_path / "wide.npz"
    np.savez(wide, arr_0=np.zeros((4, 8, 12, 1), np.uint8))
    with pytest.raises(ConfigError, match="dataset images are 8x12; set --image_size"):
        config.resolve(tiny_config(dataset="npz", data_path=str(wide), image_size=None))
    few = tmp_path / "few.npz"
    np.savez(few, arr_0=np.zeros((4, 8, 8, 1), np.uint8))
    with pytest.raises(ConfigError, match="the dataset has 4 images, fewer than --batch_size 8"):
        config.resolve(tiny_config(dataset="npz", data_path=str(few)))
    cfg, images = config.resolve(tiny_config(dataset="npz", data_path=str(few), batch_size=4, image_size=None))
    assert cfg.image_size == 8 and cfg.image_channels == 1 and images.shape == (4, 8, 8, 1)


def test_a_flagfile_with_overrides(tiny_config, tiny_images, tmp_path):
    np.savez(tmp_path / "data.npz", arr_0=tiny_images(16))
    written = tiny_config(dataset="npz", data_path=str(tmp_path / "data.npz"), random_flip=True)
    (tmp_path / "flags.cfg").write_text(config.to_flagfile(written))
    cfg, images = cli.config_from_flagfile(tmp_path / "flags.cfg", random_flip=False, channel_mult=(1, 2),
                                              lr=0.5)
    assert cfg == written.replace(random_flip=False, channel_mult=(1, 2), lr=0.5) and len(images) == 16


def test_every_field_is_checked_for_its_type_and_floats_must_be_finite(tiny_config):
    """What a stored config (a checkpoint's, not made by the flags) may hold: each field's type, finite floats."""
    wrong = {float: ["0.1", float("nan"), float("inf"), True], int: [1.5, "2", False], str: [3, None],
             bool: [1, "yes"]}
    checked = 0
    for f in dataclasses.fields(TrainConfig):
        for value in wrong.get(f.type, []):
            with pytest.raises(ConfigError, match=f"^--{f.name} must be (a finite number|an integer|a string|true or "
                                                  f"false), got {value!r}"):
                config.validate(tiny_config(**{f.name: value}))
            checked += 1
    assert checked >= 60
    with pytest.raises(ConfigError, match=r"^--channel_mult must be a list of integers, got \('1', 2\)"):
        config.validate(tiny_config(channel_mult=("1", 2)))
    config.validate(tiny_config(lr=1, world_size=None, data_path=None))  # an int stands for a float; unset fields


def test_a_flagfile_that_is_missing_or_holds_a_non_finite_number(tmp_path):
    from megdiffusion.scripts.cli import UsageError

    with pytest.raises(UsageError, match="^cannot open flagfile .*nope.cfg: No such file or directory; give an "
                                         "existing flagfile$"):
        cli.config_from_flagfile(tmp_path / "nope.cfg")
    (tmp_path / "flags.cfg").write_text("--lr=nan\n")
    with pytest.raises(UsageError, match=r"^--lr must be a finite number, got nan \(set in flagfile .*flags.cfg\)$"):
        cli.config_from_flagfile(tmp_path / "flags.cfg")


def _training_flags(argv):
    flag_values = flags.FlagValues()
    config.define_flags(flag_values)
    cli.parse_into(flag_values, ["train", *argv])
    return flag_values


def test_the_command_line_wins_over_a_flagfile_wherever_it_stands(tmp_path):
    """absl lets the later of a flag and a flagfile win; here the command line does, before or after
    --flagfile, and a flagfile's own lines win over the flagfiles it includes."""
    (tmp_path / "inner.cfg").write_text("--batch_size=3\n--total_steps=5\n")
    (tmp_path / "recipe.cfg").write_text(f"// a comment\n--logdir=recipe_run\n\n--flagfile={tmp_path / 'inner.cfg'}\n"
                                         "  --batch_size=2  \n")
    for argv in (["--logdir=mine", f"--flagfile={tmp_path / 'recipe.cfg'}"],
                 [f"--flagfile={tmp_path / 'recipe.cfg'}", "--logdir=mine"],
                 ["--logdir", "mine", "--flagfile", str(tmp_path / "recipe.cfg")]):
        parsed = _training_flags(argv)
        assert (parsed.logdir, parsed.batch_size, parsed.total_steps) == ("mine", 2, 5), argv
        assert parsed["batch_size"].default == 2  # what --help shows: the recipe's value


def test_a_flagfile_from_a_pipe_is_read_once():
    """``--flagfile=<(printf ...)``: a pipe gives its lines once; reading it twice lost every flag."""
    import os

    read, write = os.pipe()
    os.write(write, b"--batch_size=4\n--total_steps=7\n")
    os.close(write)
    try:
        parsed = _training_flags([f"--flagfile=/dev/fd/{read}"])
    finally:
        os.close(read)
    assert (parsed.batch_size, parsed.total_steps) == (4, 7)


def test_help_with_a_flagfile_shows_the_flagfiles_values(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "recipe.cfg").write_text("--batch_size=77\n--dataset=cifar10\n")
    result = subprocess.run([sys.executable, "-m", "megdiffusion.scripts.train", f"--flagfile={tmp_path}/recipe.cfg",
                             "--help"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    help_text = " ".join(result.stdout.split())
    assert "--batch_size: Global batch size" in help_text and "(default: '77')" in help_text
    assert "(default: 'cifar10')" in help_text


def test_every_field_has_one_role_and_the_lists_follow_from_them():
    """Each config field declares its role; the lists other modules keep are queries of them, and they are the sets
    the checks were written for (a field given the wrong role would change what resume or guidance compares)."""
    from megdiffusion.training import checkpoint, config, recipes

    by_role = {role: set(config.names(role=role)) for role in config.ROLES}
    assert sum(len(members) for members in by_role.values()) == len(dataclasses.fields(TrainConfig))
    assert set().union(*by_role.values()) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert by_role[config.STEP] == {"microbatch", "amp", "trace"}
    assert by_role[config.TRAINING] == {"random_flip", "dropout", "lr", "warmup_steps", "batch_size", "grad_clip",
                                        "ema_decay", "ema_warmup", "ema_profiles", "seed"}
    assert by_role[config.MATHS] == {"num_timesteps", "beta_schedule", "mean_type", "var_type", "loss_type",
                                     "min_snr_gamma", "input_perturbation", "class_dropout"}
    assert set(checkpoint.NETWORK_FIELDS) == by_role[config.NETWORK] == {
        "image_size", "image_channels", "model_channels", "channel_mult", "num_res_blocks", "attention_resolutions",
        "norm_groups", "norm_eps", "downsample_padding", "time_embedding", "use_scale_shift_norm", "num_heads",
        "num_head_channels", "rescale_timesteps", "num_classes"}
    assert set(checkpoint.GUIDE_FIELDS) == {"image_size", "image_channels", "rescale_timesteps", "num_timesteps",
                                            "beta_schedule", "mean_type", "var_type", "num_classes"}
    assert set(recipes.NETWORK_FLAGS) == {"model_channels", "channel_mult", "attention_resolutions", "num_res_blocks"}
    assert set(config.refused_on_resume()) == by_role[config.NETWORK] | by_role[config.MATHS] | by_role[config.TRAINING]
    assert set(config.refused_on_resume(allow_changes=True)) == by_role[config.NETWORK] | by_role[config.MATHS] | {
        "ema_profiles"}  # a profile holds from the first step: never one added or dropped later
    with pytest.raises(TypeError):
        config._flag(0, "a field without a role")


def test_the_unet_is_built_from_one_config_object_of_the_network_fields():
    """``UNetConfig`` holds the network role's fields (the channels named as the UNet sees them, and dropout, which
    the network applies but training decides) except rescale_timesteps, which the diffusion applies; ``build_model``
    fills it by name, so a network field the UNet does not take would fail here."""
    from megdiffusion.nn.options import UNetConfig

    unet_fields = {f.name for f in dataclasses.fields(UNetConfig)}
    network = set(config.names(role=config.NETWORK))
    assert unet_fields == network - {"image_channels", "rescale_timesteps"} | {"in_channels", "out_channels",
                                                                                "dropout"}
    cfg = config.TrainConfig(image_size=8, image_channels=1, model_channels=16, channel_mult=(1, 2), norm_groups=8,
                             attention_resolutions=(4,), num_heads=2, var_type="learned_range", num_classes=3)
    unet = config.unet_config(cfg)
    assert (unet.in_channels, unet.out_channels, unet.num_heads, unet.num_classes) == (1, 2, 2, 3)
    with pytest.raises(ValueError, match="attention_resolutions \\[16\\] never occur"):
        UNetConfig(image_size=8, channel_mult=(1, 2), attention_resolutions=(16,))


def test_a_sparse_field_is_stored_only_when_set_and_reads_back_either_way():
    """Post-hoc EMA's fields, added after runs existed: a config that does not use them is stored as before (so
    earlier versions, which refuse unknown keys, still read its checkpoints); one that does keeps them."""
    from megdiffusion.training import config

    sparse = set(config.names(sparse=True))
    assert sparse == {"ema_profiles", "snapshot_every", "snapshot_dtype"}
    plain = TrainConfig(image_size=8)
    assert not sparse & set(plain.to_dict()) and TrainConfig.from_dict(plain.to_dict()) == plain
    tracking = plain.replace(ema_profiles="0.05,0.1", snapshot_every=10)
    stored = tracking.to_dict()
    assert {"ema_profiles", "snapshot_every"} <= set(stored) and "snapshot_dtype" not in stored
    assert TrainConfig.from_dict(stored) == tracking
    assert config.profile_sigma_rels(tracking) == (0.05, 0.1) and config.profile_sigma_rels(plain) == ()
