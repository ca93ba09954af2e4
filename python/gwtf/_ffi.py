"""The C library, loaded once: `ffi` (cffi's view of `gwtf.h`) and `lib`.

The declarations come from the header the package was built with
(`_gwtf_cdef.h`, written by setup.py), so no struct is described twice.
`GWTF_LIBRARY` names another `libgwtf.so` to load (for a development build);
it must be of the same ABI version.
"""
import os
from pathlib import Path

from cffi import FFI

_HERE = Path(__file__).resolve().parent

ffi = FFI()
ffi.cdef((_HERE / "_gwtf_cdef.h").read_text())
lib = ffi.dlopen(os.environ.get("GWTF_LIBRARY") or str(_HERE / "libgwtf.so"))

if lib.gwtf_abi_version() != lib.GWTF_ABI_VERSION:
    raise ImportError(
        f"libgwtf has ABI version {lib.gwtf_abi_version()}, this package was built for "
        f"{lib.GWTF_ABI_VERSION}: reinstall it (pip install ./python)"
    )
