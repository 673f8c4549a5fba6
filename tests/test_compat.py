"""compat: MegEngine settings applied at import (worker spin cap, empty DTR candidate list, idle event polling),
quietly."""
import os
import subprocess
import sys

from megdiffusion.compat import WORKER_SPIN, cuda_driver_loadable

SPIN_VARIABLES = ("MGB_WORKER_MAX_SPIN", "MGB_WORKER_NO_SLEEP")


def run_python(code, **env):
    clean = {key: value for key, value in os.environ.items() if key not in SPIN_VARIABLES}
    result = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result


SHOW_SPIN = "import os, megdiffusion; print(os.environ.get('MGB_WORKER_MAX_SPIN'))"


def test_import_caps_the_spin_only_without_a_cuda_driver():
    expected = "None" if cuda_driver_loadable() else WORKER_SPIN  # GPU machines keep MegEngine's default
    assert run_python(SHOW_SPIN).stdout.strip() == expected


def test_user_settings_and_an_earlier_megengine_import_are_left_alone():
    assert run_python(SHOW_SPIN, MGB_WORKER_MAX_SPIN="50").stdout.strip() == "50"
    assert run_python(SHOW_SPIN, MGB_WORKER_NO_SLEEP="1").stdout.strip() == "None"
    too_late = "import megengine, os, megdiffusion; print(os.environ.get('MGB_WORKER_MAX_SPIN'))"
    assert run_python(too_late).stdout.strip().splitlines()[-1] == "None"


QUIET = "from megdiffusion.compat import quiet_megengine\nmge = quiet_megengine()\n"
IMPORT_CONV = "from megdiffusion.cpu.conv import Conv2d\n"


def stderr_of_a_conv(imports):
    """stderr of a process that runs ``imports`` and then one convolution."""
    code = ("import numpy as np\n" + imports
            + "print(Conv2d(2, 3, 3, padding=1)(mge.tensor(np.ones((2, 2, 5, 5), np.float32))).shape)")
    result = run_python(code)
    assert result.stdout.strip() == "(2, 3, 5, 5)"
    return result.stderr


def test_megengine_warning_about_the_spin_is_filtered():
    assert stderr_of_a_conv(QUIET + IMPORT_CONV) == ""
    # MegEngine imported before megdiffusion (its import banner is its own): the first op's lines are still filtered.
    stderr = stderr_of_a_conv("import megengine\n" + IMPORT_CONV + QUIET)
    assert "spin" not in stderr and "debug:" not in stderr, stderr


FIRST_IMPORT = """
import os, megdiffusion, megdiffusion.compat as compat
assert not compat._started
import megengine as mge
from megengine.core import get_option
print(type(mge.__loader__).__name__, type(mge.__spec__.loader).__name__, compat._started,
      get_option("dtr_evictee_minimum_size") == compat.NO_DTR_CANDIDATES)
for tid in sorted(os.listdir("/proc/self/task")):
    if open(f"/proc/self/task/{tid}/comm").read().strip() == "CompNodeSync":
        print(os.sched_getscheduler(int(tid)) == os.SCHED_IDLE)
"""


def test_megengine_imported_anywhere_after_megdiffusion_starts_as_quiet_megengine_starts_it():
    """A plain ``import megengine`` after ``import megdiffusion`` (a command reaching a module that needs it) is
    filtered and started like ``quiet_megengine()``, and leaves MegEngine's own loader on the module."""
    assert stderr_of_a_conv("import megdiffusion\nimport megengine as mge\n" + IMPORT_CONV) == ""
    loader, spec_loader, started, no_dtr, *idle = run_python(FIRST_IMPORT).stdout.split()
    assert loader == spec_loader != "_QuietFirstImport"
    assert (started, no_dtr) == ("True", "True")
    assert idle == [str(not cuda_driver_loadable())]


SHOW_DTR = ("import os, megdiffusion\nfrom megdiffusion.compat import quiet_megengine\nquiet_megengine()\n"
            "from megengine.core import get_option\n"
            "print(os.environ.get('MEGENGINE_DTR_EVICTEE_MINIMUM_SIZE'), get_option('dtr_evictee_minimum_size'))")


def test_dtr_candidate_list_stays_empty_whatever_the_import_order():
    """No tensor may enter MegEngine's DTR candidate list: Tensor.numpy() and the worker race on it."""
    from megdiffusion.compat import NO_DTR_CANDIDATES

    clean = {"MEGENGINE_DTR_EVICTEE_MINIMUM_SIZE": ""}
    env = {key: value for key, value in os.environ.items() if key not in clean}
    for code in (SHOW_DTR, "import megengine\n" + SHOW_DTR):
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        threshold = int(result.stdout.split()[-1])
        assert threshold == NO_DTR_CANDIDATES, (code, result.stdout)


def test_a_dtr_threshold_set_by_the_user_is_kept():
    result = run_python(SHOW_DTR, MEGENGINE_DTR_EVICTEE_MINIMUM_SIZE="2048")
    assert result.stdout.split() == ["2048", "2048"]


POLICIES = """
import os
from megdiffusion.compat import quiet_megengine
quiet_megengine()
for tid in sorted(os.listdir("/proc/self/task")):
    name = open(f"/proc/self/task/{tid}/comm").read().strip()
    print(name, os.sched_getscheduler(int(tid)) == os.SCHED_IDLE)
"""


def test_megengine_event_polling_runs_on_idle_cores_only_without_a_cuda_driver():
    """The thread that polls MegEngine's events every 10 us is SCHED_IDLE on CPU-only machines; every other thread
    keeps its class."""
    policies = dict(line.rsplit(" ", 1) for line in run_python(POLICIES).stdout.strip().splitlines())
    assert policies.pop("CompNodeSync") == str(not cuda_driver_loadable())
    assert set(policies.values()) == {"False"}
