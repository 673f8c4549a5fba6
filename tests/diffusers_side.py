"""The diffusers side of tests/test_export.py, run by a python with torch and diffusers: ``python diffusers_side.py
PIPELINE INPUTS.npz OUTPUTS.npz``.

Loads the exported directory with ``DDPMPipeline.from_pretrained``, writes its ``UNet2DModel`` output at the inputs'
``x``, ``t`` (and ``y``), then two steps of its ``DDPMScheduler`` over the full chain from ``x_T``, with the noise
each step drew (a generator seeded with the step's index: ``randn_tensor`` draws it as ``torch.randn`` does).
"""
import sys

import numpy as np
import torch
from diffusers import DDPMPipeline


def main(pipeline, inputs, outputs):
    pipe = DDPMPipeline.from_pretrained(pipeline)
    unet, scheduler = pipe.unet.eval(), pipe.scheduler
    given = np.load(inputs)
    labels = torch.from_numpy(given["y"]).long() if "y" in given else None
    with torch.no_grad():
        out = unet(torch.from_numpy(given["x"]), torch.from_numpy(given["t"]), class_labels=labels).sample
        scheduler.set_timesteps(scheduler.config.num_train_timesteps)
        sample, samples, noises = torch.from_numpy(given["x_T"]), [], []
        steps = scheduler.timesteps[:2]
        chain_labels = labels[:len(sample)] if labels is not None else None
        for index, t in enumerate(steps):
            prediction = unet(sample, t, class_labels=chain_labels).sample
            # the step splits a learned variance off first: its noise is the sample's shape
            noises.append(torch.randn(sample.shape, generator=torch.Generator().manual_seed(index)).numpy())
            sample = scheduler.step(prediction, t, sample, generator=torch.Generator().manual_seed(index)).prev_sample
            samples.append(sample.numpy())
    np.savez(outputs, out=out.numpy(), timesteps=steps.numpy(), samples=np.stack(samples), noises=np.stack(noises))


if __name__ == "__main__":
    main(*sys.argv[1:])
