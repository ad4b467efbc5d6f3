"""Build config beyond pyproject.toml: the optional native extension (stoker._jpeg: region decode, resize).

It needs only a C compiler and Python's headers (libjpeg-turbo is loaded at run time, see
csrc/jpeg_region.c). `optional=True`: where it cannot be compiled (no compiler, Windows), the
install still succeeds and stoker decodes whole images through simplejpeg, as before.
"""

import os
import sys

from setuptools import Extension, setup

ext_modules = []
if os.name == "posix":  # dlopen/dlsym; Windows keeps the simplejpeg path
    ext_modules.append(Extension(
        "stoker._jpeg",
        sources=["csrc/jpeg_region.c", "csrc/resample.c", "csrc/engine.c", "csrc/crowd.c"],
        include_dirs=["csrc/libjpeg"],
        extra_compile_args=["-O3", "-ffp-contract=off"],  # weights as libtorch rounds them: no fused multiply-add,
        libraries=["dl", "pthread"] if sys.platform.startswith("linux") else [],  # glibc < 2.34: dlopen, threads
        optional=True,
    ))

setup(ext_modules=ext_modules)
