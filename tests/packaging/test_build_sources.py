"""Both builds compile every source file: setup.py (what pip installs) and CMakeLists.txt (the C++
tests, IDEs, and CI's CMake-built operator libraries). A file added to one list and not the other
built with pip and failed to load from CMake (undefined symbol zerokern::build_lowbit), and only
CI's CMake step saw it; this check costs nothing and fails at once. csrc/emu, the SIMT emulator that
runs the CUDA kernels on the CPU for the tests, is built by tests/kernels/simt_emu.py alone, which must name
its files and every .cu of csrc/cuda."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _sources_named_in(path):
    return set(re.findall(r"csrc/[\w/]+\.(?:cpp|cu)\b", (ROOT / path).read_text()))


def test_every_source_file_is_in_both_builds():
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*")
               if p.suffix in (".cpp", ".cu") and not p.relative_to(ROOT).as_posix().startswith("csrc/emu/")}
    assert on_disk, "no csrc sources found"
    for build in ("setup.py", "CMakeLists.txt"):
        named = _sources_named_in(build)
        assert on_disk - named == set(), f"{build} does not compile {sorted(on_disk - named)}"
        assert named - on_disk == set(), f"{build} names missing files {sorted(named - on_disk)}"


def test_the_emulated_build_compiles_every_cuda_file_and_the_emulator():
    import simt_emu

    cuda = {p.name for p in (ROOT / "csrc" / "cuda").glob("*.cu")}
    assert cuda == set(simt_emu.CUDA_SOURCES), f"CUDA_SOURCES differ: {sorted(cuda ^ set(simt_emu.CUDA_SOURCES))}"
    emu = {p.name for p in (ROOT / "csrc" / "emu").glob("*.c*")}
    named = set(simt_emu.EMU_SOURCES + simt_emu.EMU_KERNELS)
    assert emu == named, f"EMU_SOURCES and EMU_KERNELS differ from csrc/emu: {sorted(emu ^ named)}"


def test_the_built_extensions_use_the_shared_libstdcxx_torch_runs_with():
    """[Note: one libstdc++] in setup.py: an extension with a private, static libstdc++ segfaulted
    on every error message that formats a number (seen on the GPU image, whose compiler has no
    shared libstdc++). Each built extension must name libstdc++.so.6 as a shared library it needs."""
    import shutil
    import subprocess

    import pytest

    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    import zerokern  # noqa: F401  the package whose extensions the tests import
    built = sorted(pathlib.Path(zerokern.__file__).parent.glob("_C*.so"))
    if not built:
        pytest.skip("no extension is built")
    for so in built:
        dynamic = subprocess.run([readelf, "-d", str(so)], capture_output=True, text=True, check=True).stdout
        assert "[libstdc++.so.6]" in dynamic, f"{so.name} does not load libstdc++.so.6: {dynamic[:2000]}"
