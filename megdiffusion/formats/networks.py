"""The network a state dict describes: its shape from the tensors' shapes, its time embedding from a stored table."""
import numpy as np

from megdiffusion.formats import ConvertError

TABLE_ATOL = 1e-3  # a float32 table is within ~6e-5 of its float64 formula; the two formulas differ by O(1)


def _shape(shapes, name):
    if name not in shapes:
        raise ConvertError(f"no tensor {name}: an incomplete state dict")
    return tuple(shapes[name])


def _levels_from(channels_of, has_attn, num_levels, model_channels):
    mult = []
    for level in range(num_levels):
        channels = channels_of(level)
        if channels % model_channels:
            raise ConvertError(f"level {level} has {channels} channels, not a multiple of {model_channels}")
        mult.append(channels // model_channels)
    return tuple(mult), tuple(level for level in range(num_levels) if has_attn(level))


def _iddpm_network(shapes):
    """``network_from_shapes`` for improved-diffusion: also use_scale_shift_norm (the time projection gives 2 * out
    values), var_type learned_range when the output has twice the input channels, and num_classes of a
    class-conditional model (``label_emb``, added to the time embedding as ours is)."""
    first = _shape(shapes, "input_blocks.0.0.weight")
    starts, index = [1], 1  # the input_blocks index of each level's first residual block
    while any(name.startswith(f"input_blocks.{index}.") for name in shapes):
        index += 1
        if f"input_blocks.{index - 1}.0.op.weight" in shapes:
            starts.append(index)
    levels, blocks = len(starts), (starts[1] - 2 if len(starts) > 1 else index - 1)
    mult, attn = _levels_from(lambda lv: _shape(shapes, f"input_blocks.{starts[lv]}.0.in_layers.2.weight")[0],
                              lambda lv: f"input_blocks.{starts[lv]}.1.qkv.weight" in shapes, levels, first[0])
    projection = _shape(shapes, "input_blocks.1.0.emb_layers.1.weight")[0]
    network = dict(model_channels=first[0], image_channels=first[1], channel_mult=mult, num_res_blocks=blocks,
                   attention_levels=attn, use_scale_shift_norm=projection == 2 * first[0] * mult[0])
    outputs = _shape(shapes, "out.2.weight")[0]
    if outputs not in (first[1], 2 * first[1]):
        raise ConvertError(f"the network maps {first[1]} image channels to {outputs}: neither the image nor the image "
                           "and a variance")
    if outputs == 2 * first[1]:
        network["var_type"] = "learned_range"  # improved-diffusion's learn_sigma
    if "label_emb.weight" in shapes:
        network["num_classes"] = _shape(shapes, "label_emb.weight")[0]
    return network


def network_from_shapes(layout, shapes):
    """The shape of the network a pesser, pytorch-ddpm, MegEngine-port or improved-diffusion state dict holds:
    model_channels, channel_mult, num_res_blocks, attention_levels and image_channels (``shapes``: name -> shape);
    for improved-diffusion also what ``_iddpm_network`` reads."""
    if layout == "improved_diffusion":
        return _iddpm_network(shapes)
    if layout == "pesser":
        first = _shape(shapes, "conv_in.weight")
        levels = 1 + max((int(n.split(".")[1]) for n in shapes if n.startswith("down.")), default=-1)
        blocks = sum(f"down.0.block.{j}.conv1.weight" in shapes for j in range(len(shapes)))
        mult, attn = _levels_from(lambda lv: _shape(shapes, f"down.{lv}.block.0.conv1.weight")[0],
                                  lambda lv: f"down.{lv}.attn.0.q.weight" in shapes, levels, first[0])
    else:
        first = _shape(shapes, "head.weight")
        starts, index = [0], 0  # the flat list index of each level's first block
        while f"downblocks.{index}.block1.2.weight" in shapes or f"downblocks.{index}.main.weight" in shapes:
            index += 1
            if f"downblocks.{index - 1}.main.weight" in shapes:
                starts.append(index)
        levels, blocks = len(starts), (starts[1] - 1 if len(starts) > 1 else index)
        mult, attn = _levels_from(lambda lv: _shape(shapes, f"downblocks.{starts[lv]}.block1.2.weight")[0],
                                  lambda lv: f"downblocks.{starts[lv]}.attn.proj_q.weight" in shapes, levels, first[0])
    return dict(model_channels=first[0], image_channels=first[1], channel_mult=mult, num_res_blocks=blocks,
                attention_levels=attn)


def _sinusoid_tables(steps, dim):
    """{time_embedding: [steps, dim] table} of both sinusoids, in float64 (``layers.timestep_embedding``)."""
    half = dim // 2
    t = np.arange(steps, dtype=np.float64)[:, None]
    ho = t * np.exp(-np.log(10000.0) * np.arange(half) / (half - 1))
    interleaved = t * np.exp(-np.log(10000.0) * 2 * np.arange(half) / dim)
    return {"ho": np.concatenate([np.sin(ho), np.cos(ho)], axis=1),
            "pytorch_ddpm": np.stack([np.sin(interleaved), np.cos(interleaved)], axis=2).reshape(steps, dim)}


def table_embedding(table):
    """Which sinusoid (``nn.options.TIME_EMBEDDINGS``) a stored [T, dim] time-embedding table holds, or None."""
    table = np.asarray(table, np.float64)
    for kind, formula in _sinusoid_tables(*table.shape).items():
        if np.abs(table - formula).max() < TABLE_ATOL:
            return kind
    return None
