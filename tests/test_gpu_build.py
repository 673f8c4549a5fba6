"""Which MegEngine build fits the card, decided on CPU with the capability given from
outside; setup.sh's MEGENGINE_WHEEL / MEGENGINE_INDEX checks (one ``error:`` line, exit 2, nothing written); the
header gpu_check.sh prints. A fake ``nvidia-smi`` on PATH stands in for a card."""
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from megdiffusion.scripts import gpu_build
from megdiffusion.scripts.gpu_build import CANNOT, FITS, JIT, KNOWN_BUILDS, BuildError

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
PYPI = KNOWN_BUILDS["cu101"]
CU118_WHEEL = "MegEngine-1.13.1+cu118-cp310-cp310-manylinux2014_x86_64.whl"
CU111_WHEEL = "MegEngine-1.12.0+cu111-cp310-cp310-manylinux2014_x86_64.whl"
PYPI_WHEEL = "MegEngine-1.13.0-cp310-cp310-manylinux2014_x86_64.whl"


def fake_nvidia_smi(directory, output="", code=0):
    """An ``nvidia-smi`` in ``directory`` that prints ``output`` and exits with ``code``; the PATH to use it."""
    directory.mkdir(parents=True, exist_ok=True)
    exe = directory / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\nprintf '%s\\n' '{output}'\nexit {code}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return f"{directory}{os.pathsep}{os.environ['PATH']}"


def env_with(**values):
    env = {k: v for k, v in os.environ.items() if k not in ("MEGENGINE_WHEEL", "MEGENGINE_INDEX")}
    env.update(values)
    return env


def tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# --- the decision ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capability, expected", [("5.2", FITS), ("7.5", FITS), ("6.0", FITS), ("6.2", FITS),
                                                  ("8.0", JIT), ("9.0", JIT), ("3.5", CANNOT), ("5.0", CANNOT)])
def test_pypi_build_on_each_card(capability, expected):
    found = gpu_build.advice(capability, PYPI)
    assert found.verdict == expected and found.fits == (expected == FITS)
    assert "\n" not in found.message and f"compute capability {capability}" in found.message
    if expected == FITS:
        assert found.recommended is None and "MEGENGINE_" not in found.message
    elif expected == JIT:  # Ampere and Hopper: the CUDA 11.8 build, and how to install it
        assert found.recommended.name == "cu118"
        assert "PTX 7.5" in found.message and "cuDNN 7.6.3" in found.message
        assert "cu118" in found.message and "MEGENGINE_INDEX=https://megengine.org.cn/whl/mge.html" in found.message
        assert "MEGENGINE_WHEEL=" in found.message
    else:  # older than every build's kernels: nothing runs it
        assert found.recommended is None and "CPU" in found.message


@pytest.mark.parametrize("capability, build", [("5.2", "cu101"), ("6.0", "cu101"), ("7.5", "cu101"),
                                               ("8.0", "cu118"), ("8.6", "cu118"), ("8.9", "cu118"),
                                               ("9.0", "cu118"), ("10.0", "cu118"), ("12.0", "cu118"),
                                               ("3.5", None), ("5.0", None)])
def test_recommended_build(capability, build):
    found = gpu_build.recommend(capability)
    assert (found.name if found else None) == build


def test_cuda11_builds():
    cu118, cu111 = KNOWN_BUILDS["cu118"], KNOWN_BUILDS["cu111"]
    assert gpu_build.verdict("9.0", cu118) == FITS and gpu_build.verdict("8.9", cu118) == FITS
    assert gpu_build.verdict("8.9", cu111) == FITS  # its 8.6 kernels run on 8.9 (same major, higher minor)
    assert gpu_build.verdict("9.0", cu111) == JIT  # PTX 8.6 only
    assert gpu_build.verdict("10.0", cu118) == JIT
    for old_card in ("5.2", "6.0"):  # kernels from 6.1, PTX 8.6 / 9.0: nothing for Maxwell or the P100
        assert gpu_build.verdict(old_card, cu118) == CANNOT and gpu_build.verdict(old_card, cu111) == CANNOT
    found = gpu_build.advice("5.2", cu118, "Tesla M40")
    assert found.verdict == CANNOT and found.recommended.name == "cu101" and "Tesla M40" in found.message
    # The newest build on a card newer than all: no other build to point to.
    assert "this one is the newest" in gpu_build.advice("10.0", cu118).message


@pytest.mark.parametrize("text, cap", [("8.0", (8, 0)), (" 9.0 ", (9, 0)), ("sm_86", (8, 6)), ("75", (7, 5)),
                                       ("12.0", (12, 0))])
def test_parse_capability(text, cap):
    assert gpu_build.parse_capability(text) == cap


@pytest.mark.parametrize("text", ["eight", "8", "8.0.1", "", "-1.0"])
def test_parse_capability_refuses(text):
    with pytest.raises(ValueError):
        gpu_build.parse_capability(text)


def test_wheel_names():
    assert gpu_build.sdk_label("1.13.1+cu118") == "cu118" and gpu_build.sdk_label("1.13.0") is None
    assert gpu_build.sdk_label("1.12.0+cu111.cudnn821.tensorrt825") == "cu111"
    assert gpu_build.wheel_build(CU118_WHEEL).name == "cu118"
    assert gpu_build.wheel_build(CU118_WHEEL).version == "1.13.1+cu118"
    assert gpu_build.wheel_build(PYPI_WHEEL) is None  # unlabelled: the name does not say
    assert gpu_build.is_megengine_wheel(CU118_WHEEL, "cp310", "x86_64")
    assert not gpu_build.is_megengine_wheel(CU118_WHEEL, "cp39", "x86_64")
    assert not gpu_build.is_megengine_wheel(CU118_WHEEL, "cp310", "aarch64")
    assert not gpu_build.is_megengine_wheel("numpy-1.26.4-cp310-cp310-manylinux2014_x86_64.whl", "cp310", "x86_64")
    assert not gpu_build.is_megengine_wheel("MegEngine-1.13.1.tar.gz", "cp310", "x86_64")


# --- the card ---------------------------------------------------------------------------------------------------


def test_no_nvidia_smi_is_none(tmp_path):
    assert gpu_build.read_gpus(str(tmp_path / "nvidia-smi")) is None
    assert gpu_build.read_gpus("no-such-nvidia-smi-here") is None


def test_failing_nvidia_smi_is_none(tmp_path):
    fake_nvidia_smi(tmp_path, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver", 9)
    assert gpu_build.read_gpus(str(tmp_path / "nvidia-smi")) is None


def test_nvidia_smi_rows(tmp_path):
    fake_nvidia_smi(tmp_path, "NVIDIA A100-SXM4-80GB, 8.0, 535.54.03")
    assert gpu_build.read_gpus(str(tmp_path / "nvidia-smi")) == [gpu_build.Gpu("NVIDIA A100-SXM4-80GB", "8.0",
                                                                                "535.54.03")]


# --- the installed build ----------------------------------------------------------------------------------------


def test_installed_pypi_build_is_read_from_its_library():
    """PyPI's 1.13.0, as installed here: the targets its fatbins hold are the table's (5.2-7.5, PTX 7.5)."""
    build = gpu_build.installed_build(load=False)
    if build is None or build.version != "1.13.0":
        pytest.skip("MegEngine 1.13.0 from PyPI is not the installed build")
    assert build.source.startswith("read from ")
    assert (build.sass, build.ptx) == (PYPI.sass, PYPI.ptx)
    assert (build.cuda, build.cudnn) == ("10.1", "7.6.3")


def test_fatbin_of_a_file_without_one(tmp_path):
    (tmp_path / "not_elf.so").write_bytes(b"\0" * 128)
    assert gpu_build.fatbin_targets(tmp_path / "not_elf.so") is None
    assert gpu_build.fatbin_targets(sys.executable) is None  # an ELF without CUDA kernels
    assert gpu_build.fatbin_targets(tmp_path / "missing.so") is None


# --- MEGENGINE_WHEEL / MEGENGINE_INDEX --------------------------------------------------------------------------


def resolve(env, capabilities=(), cwd="."):
    return gpu_build.resolve_source(env, capabilities, cwd, python_tag="cp310", machine="x86_64", timeout=5)


def test_neither_set():
    assert resolve({}) == (None, None)


def test_wheel_file(tmp_path):
    (tmp_path / CU118_WHEEL).write_bytes(b"")
    assert resolve({"MEGENGINE_WHEEL": CU118_WHEEL}, ["9.0"], tmp_path) == (str(tmp_path / CU118_WHEEL), None)
    target, warning = resolve({"MEGENGINE_WHEEL": str(tmp_path / CU118_WHEEL)}, ["10.0"])
    assert target == str(tmp_path / CU118_WHEEL) and warning.startswith("warning:") and "JIT" in warning


@pytest.mark.parametrize("env, capabilities, message", [
    ({"MEGENGINE_WHEEL": "missing.whl"}, (), "MEGENGINE_WHEEL missing.whl: no such file"),
    ({"MEGENGINE_WHEEL": "file:///no/such/dir/" + CU118_WHEEL}, (), "no such file"),
    ({"MEGENGINE_WHEEL": "numpy.whl"}, (), "is not a MegEngine wheel for CPython 3.10 on Linux x86_64"),
    ({"MEGENGINE_WHEEL": CU118_WHEEL}, ["5.2"], "holds a build that cannot run on this card"),
    ({"MEGENGINE_WHEEL": CU118_WHEEL, "MEGENGINE_INDEX": "."}, (), "not both"),
    ({"MEGENGINE_INDEX": "no_such_index"}, (), "MEGENGINE_INDEX no_such_index: no such directory or file"),
    ({"MEGENGINE_INDEX": "empty"}, (), "lists no MegEngine wheel for CPython 3.10"),
    ({"MEGENGINE_INDEX": "http://127.0.0.1:9/whl/mge.html"}, (), "cannot be read"),
    ({"MEGENGINE_WHEEL": "http://127.0.0.1:9/" + CU118_WHEEL}, (), "cannot be read"),
])
def test_bad_wheel_or_index(tmp_path, env, capabilities, message):
    (tmp_path / CU118_WHEEL).write_bytes(b"")
    (tmp_path / "numpy.whl").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BuildError, match=message.replace(".", r"\.").replace("+", r"\+")) as error:
        resolve(env, capabilities, tmp_path)
    assert "\n" not in str(error.value)


def test_index_picks_the_build_for_the_card(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in (CU118_WHEEL, CU111_WHEEL, PYPI_WHEEL, "MegEngine-1.13.1+cu118-cp38-cp38-manylinux2014_x86_64.whl",
                 "megfile-2.0.5-py3-none-any.whl"):
        (wheels / name).write_bytes(b"")
    assert resolve({"MEGENGINE_INDEX": "wheels"}, ["9.0"], tmp_path)[0] == str(wheels / CU118_WHEEL)
    assert resolve({"MEGENGINE_INDEX": str(wheels)}, ["8.6"])[0] == str(wheels / CU118_WHEEL)
    # A Maxwell card: the CUDA 11 builds cannot run; the unlabelled wheel is the only one left.
    assert resolve({"MEGENGINE_INDEX": str(wheels)}, ["5.2"])[0] == str(wheels / PYPI_WHEEL)
    (wheels / PYPI_WHEEL).unlink()
    with pytest.raises(BuildError, match="cannot run on this card"):
        resolve({"MEGENGINE_INDEX": str(wheels)}, ["5.2"])


def test_index_page(tmp_path):
    """A find-links HTML page (MegEngine's index is one): links resolved against it, ``+`` percent-encoded."""
    page = tmp_path / "mge.html"
    page.write_text('<html><a href="whl/MegEngine-1.13.1%2Bcu118-cp310-cp310-manylinux2014_x86_64.whl#sha256=00">'
                    'x</a> <a href="https://example.org/MegEngine-1.12.0+cu111-cp310-cp310-manylinux2014_x86_64.whl">'
                    'y</a></html>')
    target, _ = resolve({"MEGENGINE_INDEX": str(page)}, ["9.0"])
    assert target == (tmp_path / "whl").as_uri() + "/MegEngine-1.13.1%2Bcu118-cp310-cp310-manylinux2014_x86_64.whl"


# --- the CLI and the scripts ------------------------------------------------------------------------------------


def run(args, env=None, cwd=REPO, timeout=120):
    return subprocess.run(args, cwd=cwd, env=env or env_with(), capture_output=True, text=True, timeout=timeout)


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("capability, code", [("5.2", 0), ("7.5", 0), ("8.0", 2), ("9.0", 2), ("3.5", 2)])
def test_check_cli(capsys, capability, code):
    assert gpu_build.main(["check", "--capability", capability, "--name", "Card"]) == code
    out, err = capsys.readouterr()
    assert "gpu_check: MegEngine " in out and "CUDA 10.1" in out and "cuDNN 7.6.3" in out
    assert f"gpu_check: GPU 0: Card, compute capability {capability}" in out
    if code:
        lines = error_lines(err)
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Card (compute capability" in lines[0]
    else:
        assert "error:" not in err and out.splitlines()[-1].endswith(f"has kernels for the Card (compute capability "
                                                          f"{capability})")


def test_check_cli_allows_jit_on_request(capsys):
    assert gpu_build.main(["check", "--capability", "8.0", "--allow-jit"]) == 0
    out, _ = capsys.readouterr()
    assert out.splitlines()[-1].startswith("gpu_check: warning: ") and "cu118" in out
    assert gpu_build.main(["check", "--capability", "3.5", "--allow-jit"]) == 2  # cannot run: refused either way


def test_advise_never_fails(capsys):
    for capability in ("3.5", "8.0", "9.0", "eight"):
        assert gpu_build.main(["--capability", capability]) == 0
        out, err = capsys.readouterr()
        assert out.startswith("setup: warning: ") and out.count("\n") == 1 and err == ""
    assert gpu_build.main(["advise", "--capability", "7.5"]) == 0
    assert "has kernels for a card of compute capability 7.5" in capsys.readouterr().out


def test_check_cli_refuses_a_bad_capability(capsys):
    assert gpu_build.main(["check", "--capability", "eight"]) == 2
    assert error_lines(capsys.readouterr().err) == ["error: a compute capability looks like 8.0, not 'eight'"]


def test_source_cli(tmp_path, monkeypatch, capsys):
    (tmp_path / CU118_WHEEL).write_bytes(b"")
    monkeypatch.setenv("MEGENGINE_WHEEL", CU118_WHEEL)
    monkeypatch.delenv("MEGENGINE_INDEX", raising=False)
    assert gpu_build.main(["source", "--capability", "9.0", "--cwd", str(tmp_path)]) == 0
    assert capsys.readouterr() == (str(tmp_path / CU118_WHEEL) + "\n", "")
    assert gpu_build.main(["source", "--capability", "5.2", "--cwd", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(error_lines(err)) == 1 and err.startswith("error: MEGENGINE_WHEEL ")
    monkeypatch.delenv("MEGENGINE_WHEEL")
    assert gpu_build.main(["source", "--capability", "9.0"]) == 0 and capsys.readouterr() == ("", "")


@pytest.fixture()
def sandbox(tmp_path):
    """scripts/setup.sh and megdiffusion/scripts/gpu_build.py in a directory of their own, with no .venv: what setup.sh
    may write on a failing case shows in its tree."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / "megdiffusion" / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    shutil.copy(REPO / "megdiffusion" / "scripts" / "gpu_build.py", root / "megdiffusion" / "scripts" / "gpu_build.py")
    (tmp_path / CU118_WHEEL).write_bytes(b"")
    return root


@pytest.mark.parametrize("values, card, message", [
    ({"MEGENGINE_WHEEL": "missing/MegEngine.whl"}, None, "MEGENGINE_WHEEL missing/MegEngine.whl: no such file"),
    ({"MEGENGINE_INDEX": "no_such_dir"}, None, "MEGENGINE_INDEX no_such_dir: no such directory or file"),
    ({"MEGENGINE_INDEX": "http://127.0.0.1:9/mge.html"}, None, "cannot be read"),
    ({"MEGENGINE_WHEEL": "../" + CU118_WHEEL}, "Tesla M40, 5.2, 470.82.01", "cannot run on this card"),
])
def test_setup_refuses_before_installing(sandbox, values, card, message):
    env = env_with(**values)
    if card:
        env["PATH"] = fake_nvidia_smi(sandbox.parent / "bin", card)
    before = tree(sandbox)
    done = run(["bash", "scripts/setup.sh"], env=env, cwd=sandbox, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = error_lines(done.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr
    assert done.stdout == "" and tree(sandbox) == before  # nothing installed, nothing written


def test_setup_in_place_refuses_a_missing_wheel_first():
    """The real script, whose .venv is ready: the check comes before the ready path (nothing installed)."""
    done = run(["bash", "scripts/setup.sh"], env=env_with(MEGENGINE_WHEEL="/no/such/MegEngine.whl"), timeout=60)
    assert done.returncode == 2 and error_lines(done.stderr) == [
        "error: MEGENGINE_WHEEL /no/such/MegEngine.whl: no such file"] and done.stdout == ""


def test_setup_on_a_gpu_machine_prints_the_advice(sandbox):
    """A ready .venv (this one, through wrappers: the real one is never set up again) and a (fake) A100: setup
    verifies, prints one line naming the CUDA 11.8 build, and succeeds."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "ruff").exists():
        pytest.skip("the tests do not run from setup.sh's .venv")
    (sandbox / ".venv" / "bin").mkdir(parents=True)
    for tool in ("python", "ruff"):
        wrapper = sandbox / ".venv" / "bin" / tool
        wrapper.write_text(f'#!/bin/sh\nexec "{bin_dir / tool}" "$@"\n')
        wrapper.chmod(0o755)
    env = env_with(PATH=fake_nvidia_smi(sandbox.parent / "bin", "NVIDIA A100-SXM4-80GB, 8.0, 535.54.03"))
    done = run(["bash", "scripts/setup.sh"], env=env, cwd=sandbox, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and lines[-1].startswith("setup: .venv is ready"), done.stdout
    assert lines[0].startswith("setup: warning: ") and "NVIDIA A100-SXM4-80GB (compute capability 8.0)" in lines[0]
    assert "cu118" in lines[0] and "MEGENGINE_INDEX=" in lines[0]


def test_gpu_check_header_without_gpu(tmp_path):
    """No nvidia-smi: the header (MegEngine's version, CUDA, cuDNN, no GPU), then the refusal it always made."""
    env = env_with(PATH=os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                        if not (Path(p) / "nvidia-smi").exists()))
    done = run(["bash", "scripts/gpu_check.sh"], env=env, timeout=120)
    assert done.returncode == 2
    header = done.stdout.splitlines()
    assert header[0].startswith("gpu_check: MegEngine ") and "built with CUDA" in header[0] and "cuDNN" in header[0]
    assert header[1] == "gpu_check: no NVIDIA GPU found (nvidia-smi is absent or failed)"
    assert "MegEngine sees no CUDA GPU" in done.stderr


def test_gpu_check_refuses_a_build_that_does_not_target_the_card(tmp_path):
    """A (fake) H100 with PyPI's CUDA 10.1 build: the header, then one error line, before any row or test."""
    env = env_with(PATH=fake_nvidia_smi(tmp_path, "NVIDIA H100 80GB HBM3, 9.0, 535.104.05"))
    done = run(["bash", "scripts/gpu_check.sh"], env=env, timeout=120)
    assert done.returncode == 2
    assert "gpu_check: GPU 0: NVIDIA H100 80GB HBM3, compute capability 9.0, driver 535.104.05" in done.stdout
    lines = error_lines(done.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "cu118" in lines[0]
    assert "GPU_CHECK_ALLOW_JIT=1" in lines[0]
