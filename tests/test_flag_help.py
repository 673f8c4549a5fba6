"""Every command's flags: a help text that says something, and where it quotes a default, the flag's real default."""
import json
import re
import subprocess
import sys

import pytest

SCRIPTS = ("train", "sample", "fid", "nll", "convert", "demo", "prepare")
# What each script defines, read in a fresh process per script (the scripts share absl's global FLAGS).
LIST_FLAGS = """
import importlib, json, sys
from absl import flags
name = "megdiffusion.scripts." + sys.argv[1]
module = importlib.import_module(name)
defined = {}
for owner, flag_list in flags.FLAGS.flags_by_module_dict().items():
    if owner.startswith("megdiffusion."):
        for flag in flag_list:
            defined[flag.name] = {"help": flag.help or "", "default": flag.default}
print(json.dumps(defined, default=repr))
"""
DEFAULT_QUOTE = re.compile(r"\bdefault:? (-?\d+(?:\.\d+)?(?:e-?\d+)?)\b")


@pytest.fixture(scope="module")
def script_flags():
    runs = {name: subprocess.Popen([sys.executable, "-c", LIST_FLAGS, name], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for name in SCRIPTS}
    found = {}
    for name, run in runs.items():
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        found[name] = json.loads(out)
    return found


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_says_what_it_does_and_quotes_its_real_default(script_flags, script):
    flags = script_flags[script]
    assert flags, f"{script} defines no flags"
    for name, flag in flags.items():
        assert len(flag["help"].split()) >= 3, f"{script} --{name}: help text {flag['help']!r}"
        quoted = DEFAULT_QUOTE.search(flag["help"])
        if quoted and isinstance(flag["default"], (int, float)) and not isinstance(flag["default"], bool):
            assert float(quoted.group(1)) == float(flag["default"]), \
                f"{script} --{name}: help says default {quoted.group(1)}, the flag's default is {flag['default']}"


def test_warmup_steps_help_describes_the_schedule_the_trainer_uses(script_flags):
    from megdiffusion.training.config import TrainConfig
    from megdiffusion.training.trainer import warmup_lr

    cfg = TrainConfig(lr=1e-3, warmup_steps=4)
    assert [warmup_lr(cfg, step) for step in range(5)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert "--lr * (n + 1) / warmup_steps" in script_flags["train"]["warmup_steps"]["help"]
