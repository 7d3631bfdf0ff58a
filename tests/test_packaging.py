"""What a built wheel and sdist ship (every file the native build reads, the license, the
prebuilt kernels), how the loader picks a prebuilt variant for a CPU, that the kernels load from
an unpacked wheel with no compiler and still build from its sources, and the package surface a
fresh interpreter sees.

The builds run on a copy of the tree (no build/ output in the checkout), without build isolation
(the installed setuptools): the wheel with one prebuilt variant (AVX2, about 20 s on 2 cores;
CI's wheel check builds and checks every one), the pure wheel and the sdist a few seconds each."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import warnings
import zipfile
from pathlib import Path

import pytest

from attnkit import native
from attnkit.native import build

ROOT = Path(__file__).resolve().parents[1]
NATIVE_DIR = ROOT / "attnkit" / "native"
# What attnkit/native/__init__.py compiles and hashes: every one must be in the package.
BUILD_FILES = sorted(f"attnkit/native/{p.name}" for p in native._SOURCES + native._HEADERS)


def _setuptools_or_skip() -> None:
    setuptools = pytest.importorskip("setuptools", reason="building a wheel needs setuptools")
    major = int(re.match(r"\d+", setuptools.__version__).group())  # type: ignore[union-attr]
    if major < 77:  # pyproject.toml's build requirement (SPDX license, license-files)
        pytest.skip(f"setuptools {setuptools.__version__} < 77 cannot build this project")


def _copy_tree(dst: Path) -> Path:
    ignore = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                    ".pytest_cache", ".ruff_cache", ".benchmarks", "*.so")
    shutil.copytree(ROOT, dst, ignore=ignore)
    return dst


def _has_compiler() -> bool:
    return build.compiler() is not None


#: where the wheel's build makes prebuilt kernels (else it is the pure wheel)
PREBUILDS = build.prebuilt_unsupported_reason() is None and _has_compiler()


def _build_wheel(tmp: Path, **env: str) -> Path:
    _setuptools_or_skip()
    src = _copy_tree(tmp / "src")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(tmp / "dist"), str(src)],
        capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (built,) = (tmp / "dist").glob("attnkit-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel with one prebuilt variant, the AVX2 one (every x86-64 CI machine runs it)."""
    return _build_wheel(tmp_path_factory.mktemp("wheel"), ATTNKIT_WHEEL_KERNELS="avx2")


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    _setuptools_or_skip()
    tmp = tmp_path_factory.mktemp("sdist")
    src = _copy_tree(tmp / "src")
    code = ("import sys; from setuptools import build_meta; "
            "print(build_meta.build_sdist(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp / "dist")], cwd=src,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return tmp / "dist" / proc.stdout.strip().splitlines()[-1]


def test_build_lists_cover_the_native_sources() -> None:
    """_SOURCES and _HEADERS name every C file of attnkit/native and every local #include."""
    on_disk = sorted(f"attnkit/native/{p.name}" for p in NATIVE_DIR.iterdir()
                     if p.suffix in (".c", ".h"))
    assert on_disk == BUILD_FILES
    headers = {p.name for p in native._HEADERS}
    for src in native._SOURCES + native._HEADERS:
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', src.read_text(), re.M):
            assert name in headers, f"{src.name} includes {name}, which _HEADERS lacks"


def test_wheel_ships_every_native_build_file_and_the_license(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f for f in BUILD_FILES if f not in names]
    assert not missing, f"{wheel.name} lacks {missing}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "License-Expression: Apache-2.0" in text


def test_sdist_ships_every_native_build_file_and_the_license(sdist: Path) -> None:
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = [f for f in BUILD_FILES if f not in names]
    assert not missing, f"{sdist.name} lacks {missing}"
    assert "LICENSE" in names
    assert "setup.py" in names  # a wheel built from the sdist gets the prebuilt kernels too
    assert not [n for n in names if "_prebuilt" in n or n.endswith(".so")]


def test_native_kernels_build_from_the_unpacked_wheel(wheel: Path, tmp_path: Path) -> None:
    """Outside the checkout, with an empty kernel cache, the wheel's own files compile."""
    if not (os.environ.get("CC") or any(shutil.which(c) for c in ("cc", "gcc", "clang"))):
        pytest.skip("no C compiler: the native kernels cannot be built here")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {k: v for k, v in os.environ.items() if k != "ATTNKIT_NATIVE"}
    env.update(PYTHONPATH=str(site), ATTNKIT_CACHE_DIR=str(tmp_path / "cache"),
               ATTNKIT_NATIVE_BUILD="native")  # not the prebuilt kernels: a build here
    code = ("import attnkit, attnkit.native as n; print(attnkit.__file__); "
            "print(n.available()); print(n.unavailable_reason()); "
            "print(n.build_info().get('origin'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, ok, reason, origin = proc.stdout.strip().splitlines()[-4:]
    assert Path(where).resolve().is_relative_to(site.resolve()), where
    assert ok == "True", reason
    assert origin == "built here"


def _wheel_manifest(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as z:
        return json.loads(z.read("attnkit/native/_prebuilt/manifest.json"))


@pytest.mark.skipif(not PREBUILDS, reason="prebuilt kernels are built on Linux x86-64 with a "
                                          "C compiler only")
def test_wheel_carries_the_prebuilt_variant_and_is_tagged_for_its_platform(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    manifest = _wheel_manifest(wheel)
    with zipfile.ZipFile(wheel) as z:  # built from the very sources the wheel ships
        shipped = b"\0".join(z.read(f"attnkit/native/{p.name}") for p in build.SOURCES
                             + build.HEADERS)
    assert manifest["sources"] == build.source_digest(shipped)
    libraries = manifest["libraries"]
    assert {e["variant"] for e in libraries} == {"avx2"}  # what ATTNKIT_WHEEL_KERNELS asked
    assert sorted(e["openmp"] for e in libraries) == [False, True]
    for e in libraries:
        assert f"attnkit/native/_prebuilt/{e['file']}" in names
        assert "-march=x86-64-v3" in e["flags"] and " ".join(native._FLAGS) in e["flags"]
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl"), wheel.name
    wheel_file = next(n for n in names if n.endswith(".dist-info/WHEEL"))
    assert "Root-Is-Purelib: false" in zipfile.ZipFile(wheel).read(wheel_file).decode()


@pytest.mark.skipif(not PREBUILDS, reason="prebuilt kernels are built on Linux x86-64 with a "
                                          "C compiler only")
def test_prebuilt_kernels_load_from_the_unpacked_wheel_without_a_compiler(
        wheel: Path, tmp_path: Path) -> None:
    """No compiler on the PATH, CC naming no file, an empty cache: the AVX2 variant loads (the
    one this wheel carries) and nothing is built."""
    if build.choose_variant(build.cpu_flags(), offered=["avx2"]) is None:
        pytest.skip("this CPU does not run the AVX2 variant")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    (tmp_path / "bin").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNKIT_")}
    env.update(PYTHONPATH=str(site), ATTNKIT_CACHE_DIR=str(tmp_path / "cache"),
               PATH=str(tmp_path / "bin"), CC=str(tmp_path / "no-such-cc"))
    code = ("import warnings; warnings.simplefilter('error'); "
            "import attnkit, attnkit.native as n; print(attnkit.__file__); "
            "print(n.available(), n.unavailable_reason()); print(n.describe()); "
            "i = n.build_info(); print(i['origin'], i['variant'], i['flash_bits'])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, ok, described, info = proc.stdout.strip().splitlines()[-4:]
    assert Path(where).resolve().is_relative_to(site.resolve()), where
    assert ok == "True None", ok
    assert described.startswith("native kernels: prebuilt avx2 (") and "x86-64-v3" in described
    assert info == "prebuilt avx2 256"
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_wheel_without_a_compiler_is_the_pure_one(tmp_path: Path) -> None:
    """With no compiler at build time (CC naming no file) the wheel still builds: no prebuilt
    kernels, tagged py3-none-any, the sources inside for a build at first use."""
    built = _build_wheel(tmp_path, CC=str(tmp_path / "no-such-cc"), ATTNKIT_WHEEL_KERNELS="all")
    assert built.name.endswith("-py3-none-any.whl"), built.name
    names = set(zipfile.ZipFile(built).namelist())
    assert not [n for n in names if "_prebuilt" in n]
    assert not [f for f in BUILD_FILES if f not in names]


# A CPU's /proc/cpuinfo flags, cut to what matters (the real lines hold ~100 more, which the
# choice ignores).
BASE = {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "cx16", "popcnt", "lahf_lm", "xsave"}
HASWELL = BASE | {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "aes"}
SKYLAKE_SP = HASWELL | {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"}
ICE_LAKE = SKYLAKE_SP | {"avx512vbmi", "avx512_vnni", "avx512ifma", "avx512_vbmi2"}
COOPER_LAKE = SKYLAKE_SP | {"avx512_bf16", "avx512_vnni"}  # BF16 without VBMI
ZEN4 = ICE_LAKE | {"avx512_bf16", "avx512_bitalg", "avx512_vpopcntdq"}
SAPPHIRE_RAPIDS = ZEN4 | {"avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize("flags, avx512, want", [
    (HASWELL, True, "avx2"),
    (SKYLAKE_SP, True, "avx512"),              # AVX-512 without BF16
    (ICE_LAKE, True, "avx512"),                # VBMI without BF16
    (COOPER_LAKE, True, "avx512"),             # BF16 without VBMI
    (ZEN4, True, "avx512bf16"),
    (SAPPHIRE_RAPIDS, True, "avx512fp16"),
    (ZEN4, False, "avx2"),                     # ATTNKIT_NATIVE_AVX512=0
    (SAPPHIRE_RAPIDS, False, "avx2"),
    (HASWELL - {"f16c"}, True, None),          # AVX2 without F16C
    (BASE, True, None),                        # SSE4.2 only
    (set(), True, None),                       # nothing (no /proc/cpuinfo)
])
def test_variant_choice_follows_the_cpu_flags(flags, avx512, want) -> None:
    got = build.choose_variant(flags, avx512=avx512, machine="x86_64")
    assert (got and got.name) == want


def test_variant_choice_keeps_to_what_is_carried_and_to_x86_64() -> None:
    assert build.choose_variant(ZEN4, offered=["avx2", "avx512"], machine="x86_64").name == "avx512"
    assert build.choose_variant(ZEN4, offered=[], machine="x86_64") is None
    assert build.choose_variant(ZEN4, machine="aarch64") is None
    assert "aarch64" in build.no_variant_reason(ZEN4, machine="aarch64")
    reason = build.no_variant_reason(BASE, machine="x86_64")
    assert "avx2" in reason and "f16c" in reason and "fma" in reason and "sse4_2" not in reason
    assert "ATTNKIT_NATIVE_AVX512=0" in build.no_variant_reason(
        ZEN4, avx512=False, offered=["avx512"], machine="x86_64")
    assert "cannot be read" in build.no_variant_reason(set(), machine="x86_64")


def test_variants_are_ordered_and_each_needs_what_the_next_needs() -> None:
    for better, worse in zip(build.VARIANTS, build.VARIANTS[1:]):
        assert worse.needs < better.needs, (better.name, worse.name)
    assert [v.name for v in build.VARIANTS if not v.avx512] == ["avx2"]


def test_cpu_flags_reads_the_flags_line() -> None:
    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx2 avx512f\n"
            "bugs\t\t: sysret_ss_attrs\n\nprocessor\t: 1\nflags\t\t: fpu sse avx2 avx512f\n")
    assert build.cpu_flags(text) == {"fpu", "sse", "avx2", "avx512f"}
    assert build.cpu_flags("Features\t: fp asimd\n") == frozenset()  # aarch64: no flags line


#: the macros the sources test -> the /proc/cpuinfo flag of the same instructions
FEATURE_MACROS = {"__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c",
                  "__AVX512F__": "avx512f", "__AVX512BF16__": "avx512_bf16",
                  "__AVX512VBMI__": "avx512vbmi", "__AVX512FP16__": "avx512_fp16"}


def test_variants_cover_every_instruction_set_the_sources_test() -> None:
    """Every ISA macro in the C sources is known here, the best variant's flags define them all,
    and each variant's flags define only macros of features it needs (so the CPU runs it)."""
    tested = set()
    for src in native._SOURCES + native._HEADERS:
        tested |= set(re.findall(r"\b(__(?:AVX|F16C|FMA|AMX|SSE|BMI|VNNI)\w*__)", src.read_text()))
    unknown = tested - set(FEATURE_MACROS)
    assert not unknown, f"the sources test {unknown}: add them to FEATURE_MACROS and a variant"
    cc = build.compiler()
    if cc is None or build.prebuilt_unsupported_reason() is not None:
        pytest.skip("needs a C compiler for x86-64 to list the macros of each variant's flags")
    for variant in build.VARIANTS:
        proc = subprocess.run([cc, *variant.flags, "-dM", "-E", "-x", "c", os.devnull],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            continue  # an older compiler without these flags: the build leaves it out
        defined = {m for m in FEATURE_MACROS if f"#define {m} " in proc.stdout}
        assert {FEATURE_MACROS[m] for m in defined} <= variant.needs, variant.name
        if variant is build.VARIANTS[0]:
            assert tested <= defined, f"the best variant lacks {tested - defined}"


@pytest.fixture
def fake_prebuilt(fresh_native, tmp_path):
    """A prebuilt folder as a wheel holds it, every variant (with and without OpenMP) a link to
    this machine's own library, on a CPU that reports Zen 4's flags; yields monkeypatch."""
    fresh_native.setattr(build, "PREBUILT_DIR", tmp_path / "none")
    if not native.available():
        pytest.skip(f"the native kernels do not build here: {native.unavailable_reason()}")
    real = native.build_info()["path"]
    native._reset()
    folder = tmp_path / "_prebuilt"
    folder.mkdir()
    libraries = []
    for variant in build.VARIANTS:
        for omp in (True, False):
            name = f"attnkit_{variant.name}{'_openmp' if omp else ''}.so"
            (folder / name).symlink_to(real)
            libraries.append({"file": name, "variant": variant.name, "openmp": omp,
                              "flags": " ".join(native._FLAGS + variant.flags)})
    manifest = {"sources": build.source_digest(), "compiler": "cc", "libraries": libraries}
    (folder / build.MANIFEST).write_text(json.dumps(manifest))
    fresh_native.setattr(build, "PREBUILT_DIR", folder)
    fresh_native.setattr(build, "cpu_flags", lambda cpuinfo=None: frozenset(ZEN4))
    fresh_native.setattr(build.platform, "machine", lambda: "x86_64")
    for name in ("ATTNKIT_NATIVE", "ATTNKIT_NATIVE_AVX512", "ATTNKIT_NATIVE_BUILD"):
        fresh_native.delenv(name, raising=False)
    yield fresh_native


def _loaded() -> tuple:
    info = native.build_info()
    return info.get("origin"), info.get("variant"), Path(info.get("path", "")).name


def test_loader_takes_the_best_prebuilt_variant_for_the_cpu(fake_prebuilt) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.available(), native.unavailable_reason()
    assert _loaded() == ("prebuilt", "avx512bf16", "attnkit_avx512bf16_openmp.so")
    assert native.describe().startswith("native kernels: prebuilt avx512bf16 (")
    native._reset()
    fake_prebuilt.setattr(build, "cpu_flags", lambda cpuinfo=None: frozenset(SKYLAKE_SP))
    assert native.available() and _loaded()[:2] == ("prebuilt", "avx512")
    native._reset()
    fake_prebuilt.setenv("ATTNKIT_NATIVE_AVX512", "0")  # the AVX2 variant on any CPU
    assert native.available() and _loaded()[:2] == ("prebuilt", "avx2")


def test_native_build_switch_builds_here_and_off_switch_loads_nothing(fake_prebuilt) -> None:
    fake_prebuilt.setenv("ATTNKIT_NATIVE_BUILD", "native")
    assert native.available(), native.unavailable_reason()
    info = native.build_info()
    assert info["origin"] == "built here" and "-march=native" in info["flags"]
    assert "ATTNKIT_NATIVE_BUILD=native" in info["prebuilt_unused"]
    assert native.describe().startswith("native kernels: built here, ")
    native._reset()
    fake_prebuilt.setenv("ATTNKIT_NATIVE_BUILD", "Prebuilt ")  # case and spaces do not matter
    assert native.available() and _loaded()[0] == "prebuilt"
    native._reset()
    fake_prebuilt.setenv("ATTNKIT_NATIVE_BUILD", "nativ")
    with pytest.raises(ValueError, match="ATTNKIT_NATIVE_BUILD='nativ'.*'prebuilt'.*'native'"):
        native.available()
    native._reset()
    fake_prebuilt.setenv("ATTNKIT_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # chosen by the user: no warning
        assert not native.available()
    assert "ATTNKIT_NATIVE=0" in native.unavailable_reason()


def test_prebuilt_library_that_does_not_load_gives_way(fake_prebuilt, tmp_path) -> None:
    """An OpenMP build that does not load (no libgomp, say) gives way to the one without
    OpenMP; prebuilt kernels built from other sources are not loaded at all."""
    broken = build.PREBUILT_DIR / "attnkit_avx512bf16_openmp.so"
    broken.unlink()
    broken.write_text("not a library")
    assert native.available(), native.unavailable_reason()
    assert _loaded() == ("prebuilt", "avx512bf16", "attnkit_avx512bf16.so")
    assert "cannot load" in native.build_info()["prebuilt_error"]
    native._reset()
    manifest = json.loads((build.PREBUILT_DIR / build.MANIFEST).read_text())
    (build.PREBUILT_DIR / build.MANIFEST).write_text(json.dumps({**manifest, "sources": "0"}))
    assert native.available() and _loaded()[0] == "built here"
    assert "other sources" in native.build_info()["prebuilt_unused"]


def test_no_fitting_variant_and_no_compiler_warn_once_naming_both_kernels(
        fake_prebuilt, tmp_path) -> None:
    fake_prebuilt.setattr(build, "cpu_flags", lambda cpuinfo=None: frozenset(BASE))
    fake_prebuilt.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.warns(native.NativeKernelWarning) as record:
        assert not native.available()
        assert not native.available()
    assert len(record) == 1
    message = str(record[0].message)
    reason = native.unavailable_reason()
    assert "no C compiler" in reason and "no prebuilt variant fits" in reason
    assert "lacks" in reason and "avx2" in reason and reason in message
    assert "decoding" in message and "flash kernel" in message and "1.7-2.7x" in message
    assert record[0].filename == __file__


def test_wheel_kernel_list_is_parsed_with_errors_that_name_the_variable() -> None:
    assert build.parse_variant_names("all") == build.VARIANTS
    assert build.parse_variant_names("") == build.VARIANTS
    assert build.parse_variant_names("none") == ()
    assert [v.name for v in build.parse_variant_names("avx2, avx512bf16")] == ["avx512bf16",
                                                                              "avx2"]
    with pytest.raises(ValueError, match="ATTNKIT_WHEEL_KERNELS='avx3'.*expected.*avx512bf16"):
        build.parse_variant_names("avx3")


def test_fresh_interpreter_sees_numpy_submodule_and_out_of_pages_error() -> None:
    """``import attnkit`` alone makes ``attnkit.numpy`` (the README's front door) reachable."""
    code = ("import sys, attnkit; assert 'attnkit.numpy' in sys.modules; "
            "print(attnkit.numpy.sdpa_forward.__name__); "
            "from attnkit.paged import OutOfPagesError; "
            "print(attnkit.OutOfPagesError is OutOfPagesError, "
            "'OutOfPagesError' in attnkit.__all__, 'numpy' in attnkit.__all__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["sdpa_forward", "True", "True", "True"]
