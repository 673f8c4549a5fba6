"""Which MegEngine build fits the NVIDIA card here: the decision, the card, the installed build.

PyPI's only Linux MegEngine wheel (1.13.0) is a CUDA 10.1 build with cuDNN 7.6.3 linked in, compiled for compute
capabilities 5.2, 6.0, 6.1, 7.0 and 7.5 plus PTX of 7.5; MegEngine's own wheel index
(https://megengine.org.cn/whl/mge.html, a pip ``--find-links`` page) publishes CUDA 11 builds, versioned
``<version>+cu111`` ... ``+cu118`` (``KNOWN_BUILDS``: MegEngine's ``scripts/whl/manylinux2014/build_wheel_common.sh``).

A build and a card of compute capability X.Y meet in one of three ways (``verdict``):

- ``fits``: the build carries kernels compiled for the card (a cubin for X.y with y <= Y: NVIDIA's binary
  compatibility within a major version);
- ``jit``: it carries none, only PTX of an older architecture, which the driver compiles for the card when the
  program starts (every kernel, slow, unmeasured here) while the libraries the build links (cuDNN, cuBLAS) predate
  the card: it runs, but is not the build to measure or to train with. The build does not *target* the card;
- ``cannot``: neither a cubin the card can load nor PTX old enough for it (a card older than the build's oldest
  target): MegEngine's kernels cannot run on it at all.

``scripts/setup.sh`` warns (one line) for ``jit`` and ``cannot`` and never fails for them; ``scripts/gpu_check.sh``
refuses both in one ``error:`` line, exit 2 (``jit`` is let through with ``GPU_CHECK_ALLOW_JIT=1``).
``MEGENGINE_WHEEL`` (a wheel file or URL) or ``MEGENGINE_INDEX`` (a find-links page, URL or local, or a directory
of wheels) makes setup install that build instead of PyPI's; ``source`` checks them before anything is installed.

Standard library only, and MegEngine is imported only inside ``installed_build(load=True)``: setup.sh runs this
file with the system's CPython before the virtual environment exists (``python -I megdiffusion/scripts/gpu_build.py``).

CLI (``python -m megdiffusion.scripts.gpu_build COMMAND [--capability X.Y] [--name NAME]``):

- ``advise`` (the default): one line on the installed build and the card, for setup.sh; always exit 0.
- ``check``: gpu_check.sh's header (MegEngine's version, its CUDA and cuDNN, each card's name and compute
  capability); exit 2 with one ``error:`` line when the build does not target the card (``--allow-jit``: only when
  it cannot run on it).
- ``source [--cwd DIR]``: resolve ``MEGENGINE_WHEEL`` / ``MEGENGINE_INDEX`` to the one wheel to install, printed on
  stdout (nothing when neither is set); exit 2 with one ``error:`` line for a wheel or index that does not exist,
  is not a MegEngine wheel for this Python, or holds a build that cannot run on the card.
"""
from __future__ import annotations

import argparse
import collections
import html
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Tuple

FITS, JIT, CANNOT = "fits", "jit", "cannot"
MEGENGINE_INDEX_URL = "https://megengine.org.cn/whl/mge.html"
PYPI_BUILD = "cu101"
RECOMMENDED_CUDA11 = "cu118"

Capability = Tuple[int, int]


try:
    from megdiffusion.errors import MegdiffusionError as _Base
except ImportError:  # run as a file (setup.sh, before .venv exists): the standard library only
    _Base = Exception


class BuildError(_Base):
    """Bad input to the CLI, or a build that cannot go on the card: printed as one ``error:`` line, exit 2."""


@dataclass(frozen=True)
class Build:
    """A MegEngine build: its CUDA toolkit, its cuDNN, the compute capabilities it has kernels (cubins) for, and
    the newest architecture whose PTX it embeds (the driver compiles that for newer cards)."""

    name: str  # the wheel's SDK label: "cu101" (PyPI's), "cu118", ... or "installed" / "unknown"
    cuda: Optional[str]
    cudnn: Optional[str]
    sass: Tuple[Capability, ...]
    ptx: Optional[Capability]
    version: Optional[str] = None  # MegEngine's version, for an installed build or a wheel
    source: str = "MegEngine's build_wheel_common.sh"


def _caps(*text):
    """("6.1", "7.0") -> ((6, 1), (7, 0))."""
    return tuple(tuple(int(n) for n in t.split(".")) for t in text)


_CU11_SASS = _caps("6.1", "7.0", "7.5", "8.0", "8.6")
# x86_64 Linux wheels. cu101: CMakeLists.txt's default -gencode for CUDA >= 10 (PyPI's 1.13.0; the same set read
# from its libmegengine_shared.so's fatbins, tests/test_gpu_build.py); the others: build_wheel_common.sh.
KNOWN_BUILDS = {
    "cu101": Build("cu101", "10.1", "7.6.3", _caps("5.2", "6.0", "6.1", "7.0", "7.5"), (7, 5)),
    "cu111": Build("cu111", "11.1", "8.0.4", _CU11_SASS, (8, 6)),
    "cu112": Build("cu112", "11.2", "8.0.4", _CU11_SASS, (8, 6)),
    "cu114": Build("cu114", "11.4", "8.2.1", _CU11_SASS, (8, 6)),
    "cu118": Build("cu118", "11.8", "8.6.0", _CU11_SASS + _caps("8.9", "9.0"), (9, 0)),
}


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: Optional[str]  # "8.0"; None where neither nvidia-smi nor the driver said
    driver: Optional[str] = None


@dataclass(frozen=True)
class Advice:
    verdict: str  # FITS, JIT or CANNOT
    message: str  # one line
    recommended: Optional[Build]

    @property
    def fits(self):
        return self.verdict == FITS


# ---------------------------------------------------------------------------------------------------------------
# The decision


def parse_capability(text):
    """``"8.0"`` (or ``"sm_80"``, ``"80"``) -> ``(8, 0)``; ValueError for anything else."""
    value = str(text).strip().lower()
    match = re.fullmatch(r"(\d{1,2})\.(\d)", value)
    if match:
        return int(match.group(1)), int(match.group(2))
    match = re.fullmatch(r"(?:sm_?|compute_)?(\d{1,2})(\d)", value)
    if match:
        return int(match.group(1)), int(match.group(2))
    raise ValueError(f"a compute capability looks like 8.0, not {text!r}")


def format_capability(cap):
    return f"{cap[0]}.{cap[1]}"


def verdict(capability, build):
    """FITS, JIT or CANNOT for a card of ``capability`` ("8.0") and ``build`` (module docstring)."""
    major, minor = parse_capability(capability)
    if any(s_major == major and s_minor <= minor for s_major, s_minor in build.sass):
        return FITS
    if build.ptx is not None and build.ptx <= (major, minor):
        return JIT
    return CANNOT


def recommend(capability):
    """The build to install for a card of ``capability``: PyPI's where it fits (the one the suite runs), else the
    newest CUDA build that fits, else the newest that runs through the JIT; None where no known build runs."""
    newest_first = sorted(KNOWN_BUILDS.values(), key=lambda b: _version_key(b.cuda), reverse=True)
    for build in [KNOWN_BUILDS[PYPI_BUILD]] + newest_first:
        if verdict(capability, build) == FITS:
            return build
    for build in newest_first:  # the newest PTX is the nearest to the card
        if verdict(capability, build) == JIT:
            return build
    return None


def capability_range(caps):
    """((5, 2), (6, 0), (7, 5)) -> "5.2-7.5"; one -> "7.5"."""
    if len(caps) == 1:
        return format_capability(caps[0])
    return f"{format_capability(min(caps))}-{format_capability(max(caps))}"


def describe(build):
    """``MegEngine 1.13.0 (CUDA 10.1, cuDNN 7.6.3; kernels for 5.2-7.5; PTX 7.5)``."""
    head = f"MegEngine {build.version}" if build.version else f"MegEngine's {build.name} build"
    if not build.sass and build.ptx is None:
        return f"{head} (no CUDA kernels)"
    parts = []
    if build.cuda:
        parts.append(f"CUDA {build.cuda}" + (f", cuDNN {build.cudnn}" if build.cudnn else ""))
    parts.append(f"kernels for {capability_range(build.sass)}" if build.sass else "no cubins")
    parts.append(f"PTX {format_capability(build.ptx)}" if build.ptx else "no PTX")
    return f"{head} ({'; '.join(parts)})"


def how_to_install(build):
    """One clause: how to get ``build`` into .venv."""
    if build.name == PYPI_BUILD:
        return ("use PyPI's MegEngine 1.13.0 (CUDA 10.1): bash scripts/setup.sh without MEGENGINE_WHEEL and "
                "MEGENGINE_INDEX, or over another build .venv/bin/python -m pip install 'megengine==1.13.0' "
                "(docs/gpus.md)")
    return (f"install a CUDA {build.cuda} build (MegEngine's {build.name} wheels, kernels for "
            f"{capability_range(build.sass)}): MEGENGINE_INDEX={MEGENGINE_INDEX_URL} bash "
            f"scripts/setup.sh, or MEGENGINE_WHEEL=<file or URL of a MegEngine-*+{build.name} wheel for CPython "
            f"3.10> bash scripts/setup.sh (docs/gpus.md)")


def advice(capability, build, card=None):
    """Whether ``build`` fits a card of ``capability`` ("8.0"), and one line saying so and, where it does not,
    which build to install and how. ``card``: the card's name, for the message."""
    cap = parse_capability(capability)
    who = f"the {card} (compute capability {format_capability(cap)})" if card else \
        f"a card of compute capability {format_capability(cap)}"
    found = verdict(capability, build)
    best = recommend(capability)
    if found == FITS:
        return Advice(FITS, f"{describe(build)} has kernels for {who}", None)
    if best is not None and verdict(capability, best) == FITS:
        fix = how_to_install(best)
    elif best is not None and best.name == build.name:
        fix = "no MegEngine build has kernels for it; this one is the newest (docs/gpus.md)"
    elif best is not None:
        fix = (f"no MegEngine build has kernels for it; the newest, {best.name}, runs there through the same JIT: "
               + how_to_install(best))
    else:
        fix = "no MegEngine build runs on it: train on the CPU (docs/cpu.md)"
    if found == JIT:
        libraries = ""
        if build.cuda:
            libraries = f", and its CUDA {build.cuda}" + (f" and cuDNN {build.cudnn}" if build.cudnn else "") + \
                " predate the card"
        message = (f"{describe(build)} does not target {who}: its kernels would run only through the driver's JIT "
                   f"compilation of PTX {format_capability(build.ptx)}{libraries}; {fix}")
        return Advice(JIT, message, best)
    if not build.sass and build.ptx is None:
        reason = "it has no CUDA kernels"
    else:
        cubins = f"it has kernels for {capability_range(build.sass)} only" if build.sass else "it has no kernels"
        ptx = f"its PTX is for {format_capability(build.ptx)}, newer than the card" if build.ptx else "no PTX"
        reason = f"{cubins} and {ptx}"
    return Advice(CANNOT, f"{describe(build)} cannot run on {who}: {reason}; {fix}", best)


# ---------------------------------------------------------------------------------------------------------------
# The card


def read_gpus(nvidia_smi="nvidia-smi", timeout=20):
    """The NVIDIA cards here as ``Gpu(name, capability, driver)``, from ``nvidia-smi``; None where nvidia-smi is
    absent or fails. Never raises. A driver too old for the ``compute_cap`` field: the capability comes from the
    driver's library (libcuda), or is None."""
    exe = shutil.which(nvidia_smi)
    if exe is None:
        return None
    base = [exe, "--format=csv,noheader"]
    rows = _run(base + ["--query-gpu=name,compute_cap,driver_version"], timeout)
    with_cap = rows is not None
    if rows is None:
        rows = _run(base + ["--query-gpu=name,driver_version"], timeout)
        if rows is None:
            return None
    gpus = []
    driver_caps = None if with_cap else _driver_capabilities()
    for i, row in enumerate(rows):
        fields = [f.strip() for f in row.split(",")]
        if with_cap and len(fields) >= 3:
            name, cap, driver = ", ".join(fields[:-2]), fields[-2], fields[-1]
        elif not with_cap and len(fields) >= 2:
            name, driver = ", ".join(fields[:-1]), fields[-1]
            cap = driver_caps[i] if driver_caps and i < len(driver_caps) else None
        else:
            continue
        try:
            cap = format_capability(parse_capability(cap)) if cap else None
        except ValueError:
            cap = None
        gpus.append(Gpu(name, cap, driver or None))
    return gpus


def _run(args, timeout):
    """The stdout lines of a command that succeeded, else None."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return lines or None


def _driver_capabilities():
    """Each device's compute capability from libcuda (cuDeviceGetAttribute), or None. Never raises."""
    try:
        import ctypes

        cuda = ctypes.CDLL("libcuda.so.1")
        if cuda.cuInit(0) != 0:
            return None
        count = ctypes.c_int()
        if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return None
        caps = []
        for i in range(count.value):
            device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
            if cuda.cuDeviceGet(ctypes.byref(device), i) != 0:
                return None
            # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76
            if cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device) != 0 or \
                    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device) != 0:
                return None
            caps.append(f"{major.value}.{minor.value}")
        return caps
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------------------------
# The installed build


def installed_build(load=False):
    """The installed MegEngine as a Build, or None where it is not installed. Its kernels' targets are read from
    its library's fatbins (``fatbin_targets``), else taken from ``KNOWN_BUILDS`` by its SDK label (``+cu118``, or
    CUDA 10.1 for PyPI's unlabelled wheel); its CUDA and cuDNN come from MegEngine itself with ``load`` (an import:
    ``megengine.device.get_cuda_version`` / ``get_cudnn_version``), else from the table. Unknown fields are None."""
    import importlib.metadata
    import importlib.util

    try:
        version = importlib.metadata.version("megengine")
        spec = importlib.util.find_spec("megengine")
    except Exception:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(list(spec.submodule_search_locations)[0])
    label = sdk_label(version)
    if label is None and (package / "core" / "lib" / "libnvrtc.so.10.1").exists():
        label = "cu101"  # PyPI's wheel carries no label; MegEngine builds CUDA 10.1 only as cu101
    known = KNOWN_BUILDS.get(label)
    build = known or Build(label or "unknown", None, None, (), None, source="unknown")
    targets = None
    for lib in _libraries(package):
        targets = fatbin_targets(lib)
        if targets is not None:
            build = replace(build, sass=targets[0], ptx=targets[1], source=f"read from {lib.name}")
            break
    if targets is None and known is None:
        build = replace(build, source="unknown")
    build = replace(build, version=version)
    if load:
        cuda, cudnn = _loaded_versions()
        build = replace(build, cuda=cuda or build.cuda, cudnn=cudnn or build.cudnn)
    return build


def sdk_label(version):
    """The SDK in a MegEngine wheel's local version: ``"1.13.1+cu118"`` -> ``"cu118"``; None where it names none."""
    local = str(version).partition("+")[2].lower()
    for part in re.split(r"[._-]", local):
        if re.fullmatch(r"cu\d{3}", part):
            return part
    return None


def _libraries(package):
    """MegEngine's shared libraries, largest first (its kernels live in the largest)."""
    found = []
    for pattern in ("core/lib/*.so*", "core/*.so"):
        found.extend(p for p in package.glob(pattern) if p.is_file())
    return sorted(found, key=lambda p: p.stat().st_size, reverse=True)


def _loaded_versions():
    """(CUDA, cuDNN) MegEngine was built with, as "10.1" and "7.6.3", from MegEngine; (None, None) on failure."""
    try:
        try:
            from megdiffusion.compat import quiet_megengine

            quiet_megengine()
        except ImportError:
            pass
        import megengine.device as device

        cuda, cudnn = int(device.get_cuda_version()), int(device.get_cudnn_version())
    except Exception:
        return None, None
    # CUDA_VERSION_MAJOR * 1000 + MINOR * 10; CUDNN_MAJOR * 1000 + MINOR * 100 + PATCHLEVEL (MegEngine's docs)
    cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda > 0 else None
    cudnn_text = f"{cudnn // 1000}.{cudnn % 1000 // 100}.{cudnn % 100}" if cudnn > 0 else None
    return cuda_text, cudnn_text


_FATBIN_MAGIC = 0xBA55ED50


def fatbin_targets(path):
    """(cubin capabilities, newest PTX capability or None) of the kernels in the ELF shared library ``path``,
    read from the headers of its ``.nv_fatbin`` section (CUDA's fat binaries: one per compiled source file, each
    holding a cubin per target and PTX); None where there is no such section or it does not parse.

    A library that links cuDNN and cuBLAS statically also holds theirs, with other targets; the build's own targets
    are those of the most common set among its fat binaries (PyPI's 1.13.0: 911 of 1444)."""
    try:
        with open(path, "rb") as f:
            section = _elf_section(f, b".nv_fatbin")
            if section is None:
                return None
            offset, size = section
            end = offset + size
            signatures = collections.Counter()
            pos = offset
            while pos + 16 <= end:
                f.seek(pos)
                magic, _, header_size, fat_size = struct.unpack("<IHHQ", f.read(16))
                if magic != _FATBIN_MAGIC:
                    pos += 8  # fat binaries are 8-byte aligned: skip padding
                    continue
                entry, stop = pos + header_size, pos + header_size + fat_size
                cubins, ptx = set(), set()
                while entry + 32 <= stop:
                    f.seek(entry)
                    raw = f.read(32)
                    kind, _, entry_header, padded = struct.unpack_from("<HHII", raw)
                    sm = struct.unpack_from("<I", raw, 28)[0]
                    if entry_header == 0:
                        break
                    if kind == 2:
                        cubins.add((sm // 10, sm % 10))
                    elif kind == 1:
                        ptx.add((sm // 10, sm % 10))
                    entry += entry_header + padded
                signatures[(tuple(sorted(cubins)), max(ptx) if ptx else None)] += 1
                pos = stop
    except (OSError, struct.error, ValueError):
        return None
    if not signatures:
        return None
    return signatures.most_common(1)[0][0]


def _elf_section(f, wanted):
    """(offset, size) of the section named ``wanted`` in a little-endian ELF64 file, or None."""
    header = f.read(64)
    if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
        return None
    shoff = struct.unpack_from("<Q", header, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", header, 0x3A)
    if not shoff or shentsize < 40 or shstrndx >= shnum:
        return None
    f.seek(shoff)
    table = f.read(shentsize * shnum)

    def section(i):
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", table, i * shentsize)
        return name, offset, size

    _, names_offset, names_size = section(shstrndx)
    f.seek(names_offset)
    names = f.read(names_size)
    for i in range(shnum):
        name, offset, size = section(i)
        if names[name:names.find(b"\0", name)] == wanted:
            return offset, size
    return None


# ---------------------------------------------------------------------------------------------------------------
# MEGENGINE_WHEEL / MEGENGINE_INDEX

_WHEEL = re.compile(r"^(?P<dist>[^-]+)-(?P<version>[^-]+)(?:-\d[^-]*)?-(?P<python>[^-]+)-(?P<abi>[^-]+)-"
                    r"(?P<platform>[^-]+)\.whl$", re.I)


def wheel_info(name):
    """(version, python tags, platform tags) of a wheel file name, or None where it is not one."""
    match = _WHEEL.match(name)
    if not match:
        return None
    return match.group("version"), match.group("python").lower().split("."), match.group("platform").lower().split(".")


def is_megengine_wheel(name, python_tag, machine):
    """Whether ``name`` is a MegEngine wheel installable by CPython ``python_tag`` ("cp310") on Linux ``machine``."""
    info = wheel_info(name)
    if info is None or _WHEEL.match(name).group("dist").lower() != "megengine":
        return False
    _, pythons, platforms = info
    return python_tag in pythons and any(p.startswith(("manylinux", "linux")) and p.endswith(machine)
                                         for p in platforms)


def wheel_build(name):
    """The known build a MegEngine wheel's file name names (by its ``+cuXYZ`` label), else None."""
    info = wheel_info(name)
    if info is None:
        return None
    build = KNOWN_BUILDS.get(sdk_label(info[0]))
    return replace(build, version=info[0]) if build else None


def _is_url(text):
    return bool(re.match(r"^(https?|file)://", text, re.I))


def _url_name(url):
    return urllib.parse.unquote(Path(urllib.parse.urlparse(url).path).name)


def _local(text, cwd):
    """A local path given as a path or a file:// URL, made absolute against ``cwd``."""
    if text.lower().startswith("file://"):
        return Path(urllib.parse.unquote(urllib.parse.urlparse(text).path))
    path = Path(os.path.expanduser(text))
    return path if path.is_absolute() else Path(cwd) / path


def _fetch(url, timeout, head=False):
    """The body of ``url`` (or b"" for ``head``); BuildError where it cannot be read."""
    request = urllib.request.Request(url, method="HEAD" if head else "GET",
                                     headers={"User-Agent": "megdiffusion-setup"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return b"" if head else response.read()
    except urllib.error.HTTPError as error:
        if head and error.code in (403, 405, 501):  # a server that refuses HEAD: pip will GET it
            return b""
        raise BuildError(f"{url} cannot be read (HTTP {error.code} {error.reason})") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise BuildError(f"{url} cannot be read ({' '.join(str(reason).split())})") from None


def worst_verdict(capabilities, build):
    """The worst of ``build``'s verdicts on the cards of ``capabilities`` (CANNOT < JIT < FITS)."""
    order = {CANNOT: 0, JIT: 1, FITS: 2}
    return min((verdict(c, build) for c in capabilities), key=order.get)


def _fits_cards(build, capabilities, what):
    """A warning line (or None) for a wheel of ``build`` on the cards of ``capabilities``; BuildError where it
    cannot run on one of them."""
    if build is None or not capabilities:
        return None
    for wanted in (CANNOT, JIT):
        for capability in capabilities:
            found = advice(capability, build)
            if found.verdict == wanted == CANNOT:
                raise BuildError(f"{what} holds a build that cannot run on this card: {found.message}")
            if found.verdict == wanted == JIT:
                return f"warning: {what}: {found.message}"
    return None


def resolve_source(env, capabilities=(), cwd=".", python_tag=None, machine=None, timeout=20):
    """The wheel setup.sh is to install from ``env``'s ``MEGENGINE_WHEEL`` or ``MEGENGINE_INDEX`` (a path or URL),
    and a warning line or None; (None, None) where neither is set. ``capabilities``: the cards' ("8.0"), none
    without a GPU. BuildError (one line) for a wheel or index that does not exist or cannot be read, a file that is
    not a MegEngine wheel for this Python, an index listing none, or a build that cannot run on one of the cards.
    From an index, the wheel whose build suits the cards best (then the newest CUDA, then the newest version)."""
    python_tag = python_tag or f"cp{sys.version_info[0]}{sys.version_info[1]}"
    machine = machine or platform.machine().lower()
    capabilities = [format_capability(parse_capability(c)) for c in capabilities]
    wheel = (env.get("MEGENGINE_WHEEL") or "").strip()
    index = (env.get("MEGENGINE_INDEX") or "").strip()
    if wheel and index:
        raise BuildError("set MEGENGINE_WHEEL or MEGENGINE_INDEX, not both")
    wanted = f"MegEngine wheel for CPython {python_tag[2]}.{python_tag[3:]} on Linux {machine}"
    if wheel:
        remote = _is_url(wheel) and not wheel.lower().startswith("file://")
        name = _url_name(wheel) if _is_url(wheel) else Path(wheel).name
        if not remote:
            path = _local(wheel, cwd)
            if not path.is_file():
                raise BuildError(f"MEGENGINE_WHEEL {wheel}: no such file")
        if not is_megengine_wheel(name, python_tag, machine):
            raise BuildError(f"MEGENGINE_WHEEL {wheel} is not a {wanted} (a name like "
                             f"MegEngine-1.13.1+cu118-{python_tag}-{python_tag}-manylinux2014_{machine}.whl)")
        warning = _fits_cards(wheel_build(name), capabilities, f"MEGENGINE_WHEEL {wheel}")
        if remote:
            _fetch(wheel, timeout, head=True)
            return wheel, warning
        return str(path.resolve()), warning
    if index:
        candidates = _index_wheels(index, cwd, timeout)
        usable = [(name, where) for name, where in candidates if is_megengine_wheel(name, python_tag, machine)]
        if not usable:
            raise BuildError(f"MEGENGINE_INDEX {index} lists no {wanted}")
        name, where = max(usable, key=lambda item: _rank(item[0], capabilities))
        warning = _fits_cards(wheel_build(name), capabilities, f"MEGENGINE_INDEX {index}'s best wheel, {name},")
        return where, warning
    return None, None


def _index_wheels(index, cwd, timeout):
    """(file name, path or URL) of each wheel a find-links index lists: a directory, an HTML file or a URL."""
    if _is_url(index) and not index.lower().startswith("file://"):
        page = _fetch(index, timeout).decode("utf-8", "replace")
        base = index
    else:
        path = _local(index, cwd)
        if path.is_dir():
            return [(p.name, str(p.resolve())) for p in sorted(path.glob("*.whl"))]
        if not path.is_file():
            raise BuildError(f"MEGENGINE_INDEX {index}: no such directory or file")
        page = path.read_text(encoding="utf-8", errors="replace")
        base = path.resolve().as_uri()
    found = []
    for href in re.findall(r"""href\s*=\s*["']([^"']+)["']""", page, re.I):
        url = urllib.parse.urljoin(base, html.unescape(href).split("#")[0])
        name = _url_name(url)
        if name.lower().endswith(".whl"):
            found.append((name, url))
    return found


def _rank(name, capabilities):
    """Sort key of an index's wheel: its verdict on the cards, then its CUDA, then its version."""
    build = wheel_build(name)
    version = wheel_info(name)[0].partition("+")[0]
    if not capabilities:
        fit = 1
    elif build is None:
        fit = 0  # a build the file name does not name: below any known one that runs
    else:
        fit = {FITS: 3, JIT: 2, CANNOT: -1}[worst_verdict(capabilities, build)]
    cuda = _version_key(build.cuda) if build else ()
    return fit, cuda, _version_key(version)


def _version_key(text):
    """"1.13.2" -> (1, 13, 2); pre-releases sort below releases ("1.13.0rc1" -> (1, 13, -1))."""
    key = []
    for part in str(text or "").split("."):
        match = re.match(r"(\d+)(.*)", part)
        if not match:
            break
        key.append(int(match.group(1)))
        if match.group(2):
            key.append(-1)
            break
    return tuple(key)


# ---------------------------------------------------------------------------------------------------------------
# CLI


def _cards(args):
    """[Gpu] from --capability / --name, else from nvidia-smi (None: no nvidia-smi)."""
    if args.capability is not None:
        return [Gpu(args.name or "", format_capability(parse_capability(args.capability)))]
    return read_gpus()


def _worst(cards, build):
    """The card whose advice is worst, and that advice; (None, None) where no card has a known capability."""
    order = {CANNOT: 0, JIT: 1, FITS: 2}
    judged = [(card, advice(card.capability, build, card.name or None)) for card in cards if card.capability]
    if not judged:
        return None, None
    return min(judged, key=lambda item: order[item[1].verdict])


def _advise(args):
    cards = _cards(args)
    if not cards:
        return 0  # no GPU: nothing to say
    build = installed_build(load=False)
    if build is None:
        print("setup: warning: MegEngine is not installed in this environment")
        return 0
    card, found = _worst(cards, build)
    if found is None:
        names = ", ".join(c.name for c in cards)
        print(f"setup: {names}: compute capability unknown (nvidia-smi has no compute_cap and libcuda said "
              f"nothing); {describe(build)}; which build fits: docs/gpus.md")
    elif found.fits:
        print(f"setup: {found.message}")
    else:
        print(f"setup: warning: {found.message}")
    return 0


def _check(args):
    build = installed_build(load=True)
    if build is None:
        raise BuildError("MegEngine is not installed in this environment (bash scripts/setup.sh)")
    cuda = f"CUDA {build.cuda}" if build.cuda else "CUDA unknown"
    cudnn = f"cuDNN {build.cudnn}" if build.cudnn else "cuDNN unknown"
    targets = (", ".join(format_capability(c) for c in build.sass) or "none") + \
        (f"; PTX {format_capability(build.ptx)}" if build.ptx else "; no PTX")
    origin = build.source if build.source != "unknown" else "targets unknown"
    print(f"gpu_check: MegEngine {build.version}, built with {cuda} and {cudnn}; kernels for compute capability "
          f"{targets} ({origin})")
    cards = _cards(args)
    if cards is None:
        print("gpu_check: no NVIDIA GPU found (nvidia-smi is absent or failed)")
        return 0
    for i, card in enumerate(cards):
        driver = f", driver {card.driver}" if card.driver else ""
        print(f"gpu_check: GPU {i}: {card.name or 'a card'}, compute capability {card.capability or 'unknown'}"
              f"{driver}")
    card, found = _worst(cards, build)
    if found is None:
        print("gpu_check: warning: the card's compute capability is unknown; which build fits: docs/gpus.md")
        return 0
    if found.verdict == CANNOT or (found.verdict == JIT and not args.allow_jit):
        rerun = " (GPU_CHECK_ALLOW_JIT=1 measures it anyway)" if found.verdict == JIT else ""
        raise BuildError(found.message + rerun)
    if found.verdict == JIT:
        print(f"gpu_check: warning: {found.message}")
    else:
        print(f"gpu_check: {found.message}")
    return 0


def _source(args):
    cards = _cards(args) or []
    target, warning = resolve_source(os.environ, [c.capability for c in cards if c.capability], args.cwd)
    if warning:
        print(f"setup: {warning}", file=sys.stderr)
    if target:
        print(target)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m megdiffusion.scripts.gpu_build",
                                     description="Which MegEngine build fits the NVIDIA card here (docs/gpus.md).")
    parser.add_argument("command", nargs="?", default="advise", choices=("advise", "check", "source"))
    parser.add_argument("--capability", help="the card's compute capability (e.g. 8.0) instead of nvidia-smi's")
    parser.add_argument("--name", help="the card's name, with --capability")
    parser.add_argument("--allow-jit", action="store_true",
                        help="check: let a build that runs on the card only through PTX JIT pass, with a warning")
    parser.add_argument("--cwd", default=os.getcwd(),
                        help="source: the directory relative MEGENGINE_WHEEL / MEGENGINE_INDEX paths start from")
    args = parser.parse_args(argv)
    try:
        if args.capability is not None:
            parse_capability(args.capability)
        return {"advise": _advise, "check": _check, "source": _source}[args.command](args)
    except (BuildError, ValueError) as error:
        if args.command == "advise":  # setup never fails over the GPU
            print(f"setup: warning: {' '.join(str(error).split())}")
            return 0
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
