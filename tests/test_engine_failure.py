"""A failure of MegEngine itself: one ``error:`` line naming the first cause, exit 1, checkpoints intact."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from megdiffusion.compat import is_megengine_error, megengine_error_cause
from megdiffusion.training.checkpoint import list_checkpoints, load_latest

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ["--batch_size=8", "--sample_every=0", "--log_every=1", "--save_every=2"]

# The train script, with a real MegEngine error (a C++ assertion) raised inside training step 4.
FAILING_TRAIN = """
import sys
from megdiffusion.compat import quiet_megengine
mge = quiet_megengine()
from megdiffusion.scripts import train as script
from megdiffusion.training import trainer

original_step = trainer.Trainer.step

def step(self, x0, labels=None, draws=None):
    if self.step_count == 3:
        mge.functional.reshape(mge.tensor([1.0] * 20), (3, 7)).numpy()
    return original_step(self, x0, labels, draws)

trainer.Trainer.step = step
sys.argv = ["train"] + sys.argv[1:]
script.run()
"""


def run(code_or_module, *args):
    command = ["-c", code_or_module] if "\n" in code_or_module else ["-m", code_or_module]
    return subprocess.run([sys.executable, *command, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=240, env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_training_failure_is_one_line_exit_1_and_resume_continues(tiny_model_flags, tiny_images, tmp_path):
    np.savez(tmp_path / "data.npz", tiny_images(32))
    logdir = tmp_path / "run"
    args = ["--dataset=npz", f"--data_path={tmp_path / 'data.npz'}", *tiny_model_flags, *SETTINGS, f"--logdir={logdir}",
            "--total_steps=6"]

    failed = run(FAILING_TRAIN, *args)
    assert failed.returncode == 1, failed.stderr
    assert "Traceback" not in failed.stderr and "backtrace" not in failed.stderr, failed.stderr
    [line] = [line for line in failed.stderr.splitlines() if "error" in line.lower()]  # beside the progress bar
    assert failed.stderr.strip().splitlines()[-1] == line
    assert line.startswith("error: MegEngine failed at training step 4: assertion `"), line
    assert ".cpp:" in line and "/home/" not in line and "backtrace" not in line, line  # the cause, no C++ noise
    newest = list_checkpoints(str(logdir))[-1]
    assert newest.endswith("ckpt_0000002.pkl") and newest in line, line
    assert line.endswith("continue with the same command and --resume"), line
    checkpoint, _ = load_latest(str(logdir))
    assert checkpoint["step"] == 2

    resumed = run("megdiffusion.scripts.train", *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    assert load_latest(str(logdir))[0]["step"] == 6


def test_the_first_cause_is_found_behind_an_async_report():
    # The chain MegEngine raised when its worker failed (texts as seen in benchmarks/megengine_candidate_race.py, in
    # git's history).
    worker = RuntimeError("assertion `ptr->cand_index == UINT_MAX' failed at /home/code/imperative/src/impl/"
                          "interpreter/interpreter_impl.cpp:1696: void mgb::ChannelImpl::insert_candidate(T*)\n"
                          "extra message: got wrong candidate index\n\nbacktrace:\n/lib/x.so(+0x1) [0x2]")
    try:
        try:
            raise worker
        except RuntimeError as error:
            raise RuntimeError("An async error is reported. See above for the actual cause.") from error
    except RuntimeError as reported:
        assert is_megengine_error(reported)
        assert megengine_error_cause(reported) == ("assertion `ptr->cand_index == UINT_MAX' failed "
                                                   "(interpreter_impl.cpp:1696): got wrong candidate index")
    assert not is_megengine_error(RuntimeError("a bug of ours")) and not is_megengine_error(ValueError("x"))
