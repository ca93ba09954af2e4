"""Builds the package with its own copy of libgwtf.

`pip install ./python` from a checkout runs `cargo build --release --lib` in
the repository above this directory, copies `libgwtf.so` into the package,
and turns `include/gwtf.h` into the declarations cffi reads at import time
(the header is the one source of the ABI: nothing here repeats a struct).
GWTF_PYTHON_PROFILE=debug takes the debug build instead (what the test
script uses, since it has built that already).
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def cdef_of(header: Path) -> str:
    """The header as cffi's `cdef` takes it: the C (not C++) branch of its
    conditionals, without comments, includes or the include guard, and its
    integer constants as `#define NAME VALUE` lines."""
    text = header.read_text()
    body = "\n".join(
        line for line in text.splitlines() if not line.startswith("#include")
    )
    cc = os.environ.get("CC", "cc")
    pre = subprocess.run(
        [cc, "-E", "-P", "-std=c11", "-x", "c", "-"],
        input=body, capture_output=True, text=True, check=True,
    ).stdout
    defines = []
    for name, value in re.findall(r"^#define\s+(GWTF_\w+)\s+(.+?)\s*$", text, re.M):
        if re.fullmatch(r"[-()0-9<< ]+", value):
            # Only integer literals and shifts (checked above) are evaluated.
            defines.append(f"#define {name} {eval(value)}")
    return "\n".join(defines) + "\n" + pre


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        profile = os.environ.get("GWTF_PYTHON_PROFILE", "release")
        if profile not in ("release", "debug"):
            raise SystemExit(f"GWTF_PYTHON_PROFILE must be release or debug, not {profile!r}")
        cargo = ["cargo", "build", "--lib"] + (["--release"] if profile == "release" else [])
        subprocess.run(cargo, cwd=REPO, check=True)
        target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
        out = Path(self.build_lib) / "gwtf"
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(target / profile / "libgwtf.so", out / "libgwtf.so")
        (out / "_gwtf_cdef.h").write_text(cdef_of(REPO / "include" / "gwtf.h"))


class BinaryDistribution(Distribution):
    """The wheel holds a shared library: it is for this platform only."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithLibrary}, distclass=BinaryDistribution)
