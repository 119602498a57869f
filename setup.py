"""Builds the C11 extension ember._C from csrc/ (every .c file below it, one folder per pipeline stage).

EMBER_WERROR=1 (set by CI) turns warnings into errors; EMBER_DEBUG=1 keeps EM_ASSERT and -O0 -g;
EMBER_SANITIZE=1 adds AddressSanitizer and UBSan.
"""
import glob
import os

from setuptools import Extension, setup

here = os.path.dirname(os.path.abspath(__file__))
sources = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "csrc", "**", "*.c"), recursive=True))
flags = ["-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers", "-fvisibility=hidden"]
if os.environ.get("EMBER_WERROR") == "1":
    flags.append("-Werror")
if os.environ.get("EMBER_DEBUG") == "1":
    flags += ["-O0", "-g", "-DEM_DEBUG=1"]
else:
    flags += ["-O2"]
link = []
if os.environ.get("EMBER_SANITIZE") == "1":
    flags += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    link += ["-fsanitize=address,undefined"]

setup(
    ext_modules=[
        Extension(
            "ember._C",
            sources=sources,
            include_dirs=["csrc"],
            define_macros=[("Py_BUILD_CORE_MODULE", "1")],
            extra_compile_args=flags,
            extra_link_args=link,
        )
    ]
)
