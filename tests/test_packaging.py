"""The wheel carries everything a `pip install` user needs: scripts, configs and the embedded data; the package's
modules import each other without cycles, and the names users import keep working."""
import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(ROOT)], check=True, capture_output=True)
    (path,) = out.glob("megdiffusion-*.whl")
    with zipfile.ZipFile(path) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def test_wheel_contains_scripts_configs_and_data(wheel):
    for module in ("train", "sample", "fid", "convert", "nll", "prepare"):
        assert f"megdiffusion/scripts/{module}.py" in wheel
    for config in ("cifar10", "celebahq256", "lsun_church256", "fashion_mnist_cpu", "iddpm_cifar10", "own32", "own64"):
        assert f"megdiffusion/configs/{config}.cfg" in wheel
    embedded = ROOT / "megdiffusion/data/assets/t10k-images-idx3-ubyte.gz"
    assert wheel["megdiffusion/data/assets/t10k-images-idx3-ubyte.gz"] == embedded.read_bytes()
    for package in LAYERS:
        assert f"megdiffusion/{package}/__init__.py" in wheel


def test_wheel_declares_entry_points_and_dependencies(wheel):
    dist_info = next(name.split("/")[0] for name in wheel if name.endswith(".dist-info/METADATA"))
    entry_points = wheel[f"{dist_info}/entry_points.txt"].decode()
    metadata = wheel[f"{dist_info}/METADATA"].decode()
    for name in ("train", "sample", "fid", "convert", "nll", "prepare"):
        assert f"megdiffusion-{name} = megdiffusion.scripts.{name}:run" in entry_points
    for requirement in ("megengine>=1.9", "numpy<2", "absl-py", "tqdm", "pillow", "numba==0.61.2"):
        assert f"Requires-Dist: {requirement}" in metadata
    assert "Requires-Python: >=3.10,<3.11" in metadata
    # torch is only the bench extra (benchmarks/vs_pytorch.py), never a requirement of the package.
    torch_lines = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: torch")]
    assert torch_lines == ['Requires-Dist: torch; extra == "bench"']


@pytest.mark.parametrize("script, flag", [("train", "--batch_size"), ("sample", "--sampler"),
                                          ("fid", "--save_stats"), ("demo", "--minutes"), ("convert", "--ema"),
                                          ("nll", "--respacing"), ("prepare", "--labels"),
                                          # the flags defined once for several commands (scripts/shared_flags.py)
                                          ("sample", "--spacing:"), ("sample", "--guide_ckpt:"),
                                          ("fid", "--guidance:"), ("demo", "--spacing:"), ("nll", "--ckpt:"),
                                          ("convert", "<auto|diffusers|pesser|pytorch_ddpm|"
                                                                   "megengine_port|improved_diffusion>")])
def test_scripts_print_their_flags(script, flag):
    result = subprocess.run([sys.executable, "-m", f"megdiffusion.scripts.{script}", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert flag in result.stdout, result.stderr  # (absl exits with 1 after --help)


def _module_imports():
    """{module: the package's modules it imports anywhere in its code}; ``from package import name`` counts as
    importing the submodule ``package.name`` when there is one, else the package."""
    files = {}
    for path in (ROOT / "megdiffusion").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                submodules = {f"{node.module}.{alias.name}" for alias in node.names} & set(files)
                targets.update(submodules or {node.module})
        graph[module] = {target for target in targets if target in files and target != module}
    return graph


def test_no_module_imports_itself_through_others():
    graph = _module_imports()
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            assert state.get(target) != "open", f"import cycle: {' -> '.join(path + [target])}"
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


# The package's folders from the top down (docs/architecture.md): a module imports only from its own folder and the
# folders below it, and from the modules at the package's root (shared helpers, below every folder).
LAYERS = ("scripts", "sampling", "formats", "training", "metrics", "diffusion", "data", "nn", "cpu", "files")
ROOT_MODULES = ("compat", "environment", "errors", "processes", "progress")  # at most five: the rest live in folders


def _layer(module):
    """The rank of ``module``'s folder in ``LAYERS`` (0: the top); the package's root modules rank below them all."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 2 or parts[1:] and parts[1] in LAYERS else len(LAYERS)


def upward_imports(graph):
    """Every import of ``graph`` (``_module_imports``'s) from a folder into one above it: "a -> b" lines. The package
    itself (``megdiffusion/__init__.py``, the names users import) stands above all."""
    return [f"{module} -> {target}" for module, targets in sorted(graph.items()) if module != "megdiffusion"
            for target in sorted(targets) if _layer(target) < _layer(module)]


def test_every_folder_is_in_the_layers_and_no_import_runs_upward():
    folders = {path.name for path in (ROOT / "megdiffusion").iterdir() if (path / "__init__.py").exists()}
    assert folders == set(LAYERS)
    loose = sorted(path.stem for path in (ROOT / "megdiffusion").glob("*.py") if path.stem != "__init__")
    assert loose == sorted(ROOT_MODULES) and len(loose) <= 5
    assert upward_imports(_module_imports()) == []


def test_an_upward_import_is_found():
    graph = _module_imports()
    graph["megdiffusion.cpu.conv"] = graph["megdiffusion.cpu.conv"] | {"megdiffusion.nn.layers"}
    graph["megdiffusion.errors"] = graph["megdiffusion.errors"] | {"megdiffusion.data.loader"}
    assert upward_imports(graph) == ["megdiffusion.cpu.conv -> megdiffusion.nn.layers",
                                     "megdiffusion.errors -> megdiffusion.data.loader"]


def test_the_names_users_import_keep_working():
    code = ("from megdiffusion.nn import UNet; from megdiffusion import diffusion, training, sampling; "
            "from megdiffusion.sampling import load_model, read_samples; import megdiffusion.scripts.train; "
            "from megdiffusion import GaussianDiffusion; assert callable(sampling.load_model); "
            "from megdiffusion.cpu.choice import use_cpu_engine, cpu_engine_enabled")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
