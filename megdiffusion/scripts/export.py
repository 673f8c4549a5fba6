"""Export a trained model: ``python -m megdiffusion.scripts.export CKPT OUT --to diffusers|mge|onnx [--noema]``.

CKPT: anything ``megdiffusion.load`` reads (a checkpoint, a run's logdir, a published checkpoint ``scripts.convert``
reads). OUT, by ``--to``:

- ``diffusers``: a ``DDPMPipeline`` directory (``model_index.json``, ``unet/``, ``scheduler/``) with our betas,
  prediction, variance and clipping; refused in one line for networks diffusers cannot describe.
- ``mge``: the network traced and dumped for MegEngine Lite (``megenginelite``) and MegEngine's graph loader, inputs
  ``x``, ``t`` (and ``y``), output ``out``; traced at ``--batch_size``, it runs at any batch. ``scripts.sample --ckpt
  OUT.mge`` samples from it.
- ``onnx``: the network as an ONNX graph (``--opset``), inputs and output as the ``.mge``'s, the batch dynamic.

The timestep input ``t`` is what the network sees: the integer step, or with rescaled timesteps step * 1000 / T.
Bad input: one ``error:`` line, exit code 2; nothing is written unless the whole export succeeds
(docs/elsewhere.md).
"""
import os

from absl import flags

from megdiffusion.files.disk import OutputError, check_not_input, check_writable
from megdiffusion.formats import EXPORT_TARGETS
from megdiffusion.formats.onnx_graph import OPSETS
from megdiffusion.scripts import cli, shared_flags
from megdiffusion.scripts.cli import UsageError, define_integer, megengine_failures, one_line_errors

FLAGS = flags.FLAGS
flags.DEFINE_enum("to", None, EXPORT_TARGETS, "What to write: a diffusers DDPMPipeline directory, a MegEngine Lite "
                  "graph (.mge) or an ONNX graph (.onnx).")
shared_flags.define_ema_flag()
shared_flags.define_overwrite_flag()
shared_flags.define_batch_size(1, "--to mge: the batch the graph is traced at; MegEngine 1.13 keeps the batch "
                               "dynamic, so the graph runs at any.")
define_integer("opset", OPSETS.stop - 1, "--to onnx: the ONNX opset of the graph.", min=OPSETS.start,
               max=OPSETS.stop - 1)
flags.adopt_module_key_flags(cli)
flags.adopt_module_key_flags(shared_flags)


def _check_output(out, target, overwrite):
    """The OUT checks before any work: a file for mge and onnx, a pipeline directory for diffusers (an existing one
    replaced only with --overwrite, and only if it is a diffusers pipeline)."""
    if target != "diffusers":
        check_writable(out, "OUT", directory=False, overwrite=overwrite)
        return
    check_writable(out, "OUT")
    if os.path.isdir(out) and os.listdir(out):
        if not overwrite:
            raise OutputError(f"OUT {out} exists; give a new directory, or --overwrite to replace it")
        if not os.path.isfile(os.path.join(out, "model_index.json")):
            raise OutputError(f"OUT {out} holds files but no model_index.json: not a diffusers pipeline, so "
                              "--overwrite does not replace it; give a new directory")


def main(argv):
    from megdiffusion.sampling.model import load

    with one_line_errors(), megengine_failures("nothing was written; rerun the same command"):
        if len(argv) != 3:
            raise UsageError(f"expected two arguments, CKPT OUT; got {len(argv) - 1}")
        if FLAGS.to is None:
            raise UsageError(f"--to is required: one of {', '.join(EXPORT_TARGETS)}")
        src, out = argv[1:]
        check_not_input(out, "OUT", src)
        _check_output(out, FLAGS.to, FLAGS.overwrite)
        model = load(src, ema=FLAGS.ema)
        what = model.export(out, FLAGS.to, FLAGS.batch_size, FLAGS.opset)
    print(f"wrote {out}: {what}; {model!r}")


def run():
    """Console entry point (``megdiffusion-export``)."""
    cli.run_command(main)


if __name__ == "__main__":
    run()
