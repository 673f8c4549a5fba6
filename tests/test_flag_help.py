"""Every command's flags: a help text that says something, and where it quotes a default, the flag's real default."""
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS_DIR = Path(__file__).resolve().parents[1] / "megdiffusion" / "scripts"
# Every command: each module of megdiffusion/scripts with a main (cli.py and shared_flags.py are what they share).
SCRIPTS = tuple(sorted(path.stem for path in SCRIPTS_DIR.glob("*.py")  # the absl commands (gpu_build is argparse)
                      if "\ndef main(" in path.read_text() and "from absl import" in path.read_text()))
# What each script defines, read in a fresh process per script (the scripts share absl's global FLAGS).
LIST_FLAGS = """
import importlib, json, sys
from absl import flags
from megdiffusion.scripts.cli import flag_bounds
name = "megdiffusion.scripts." + sys.argv[1]
module = importlib.import_module(name)
defined = {}
for owner, flag_list in flags.FLAGS.flags_by_module_dict().items():
    if owner.startswith("megdiffusion."):
        for flag in flag_list:
            defined[flag.name] = {"help": flag.help or "", "default": flag.default,
                                  "bounds": flag_bounds(flags.FLAGS, flag.name)}
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


def test_a_flag_several_commands_take_has_one_bound_default_and_help(script_flags):
    from megdiffusion.scripts.shared_flags import OWN_FLAGS

    assert {"train", "sample", "fid", "nll", "convert", "demo", "prepare"} <= set(SCRIPTS)
    takers = {}
    for script, defined in script_flags.items():
        for name, flag in defined.items():
            takers.setdefault(name, {})[script] = flag
    for name, by_script in takers.items():
        bounds = {script: flag["bounds"] for script, flag in by_script.items()}
        assert len({json.dumps(b, sort_keys=True) for b in bounds.values()}) == 1, f"--{name}'s bounds: {bounds}"
        shared = {script: json.dumps([flag["default"], flag["help"]]) for script, flag in by_script.items()
                  if (script, name) not in OWN_FLAGS}
        assert len(set(shared.values())) <= 1, f"--{name} differs between {sorted(shared)}: {shared}"
    for script, name in OWN_FLAGS:  # each exception is needed: the flag exists and differs from another command's
        own = script_flags[script][name]
        others = [flag for other, flag in takers[name].items() if other != script]
        assert any((flag["default"], flag["help"]) != (own["default"], own["help"]) for flag in others), \
            f"{script} --{name} is listed in OWN_FLAGS but is the shared flag"


FLAG_MENTION = re.compile(r"(?<![\w-])--([a-z][a-z0-9_]*)(?![\w-])")
# Flags a message may name that no command defines: absl's own, and "--name" standing for any flag.
ABSL_FLAGS = {"flagfile", "help", "helpfull", "helpshort", "undefok"}
PLACEHOLDERS = {"name", "sample_"}  # training.config turns a sampler message's --steps into --sample_steps


def mentioned_flags():
    """{flag name: files} of every ``--name`` in the package's string literals and the literal parts of its f-strings
    (a part that ends where a value is put in, ``f"--no{name}"``, names no flag by itself)."""
    found = {}
    for path in (SCRIPTS_DIR.parent).rglob("*.py"):
        tree = ast.parse(path.read_text())
        partial = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
                   for part, after in zip(node.values, node.values[1:]) if isinstance(after, ast.FormattedValue)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for match in FLAG_MENTION.finditer(node.value):
                    if not (id(node) in partial and match.end() == len(node.value)):
                        found.setdefault(match.group(1), set()).add(path.name)
    return found


def argparse_options():
    """The options of the package's argparse command lines (``gpu_build``)."""
    return {arg.value[2:] for path in SCRIPTS_DIR.parent.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
            for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")}


def test_every_flag_a_message_names_exists(script_flags):
    defined = {name for flags in script_flags.values() for name in flags} | argparse_options()
    defined |= {f"no{name}" for name in defined}  # a boolean's negation
    missing = {name: files for name, files in mentioned_flags().items()
               if name not in defined | ABSL_FLAGS | PLACEHOLDERS}
    assert not missing, f"flags named in messages that no command defines: {missing}"
    assert {"logdir", "init_from", "noema"} <= set(mentioned_flags())  # the walk reads the messages
