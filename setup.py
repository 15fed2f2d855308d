"""Build the compiled hot path: Cython compiles the modules listed in
``protocol/accel.py`` (COMPILED_MODULES) from their ``.py`` sources, with the C
types of the ``.pxd`` files beside them. Everything else is in pyproject.toml.

``WHEELD_NO_EXTENSIONS=1`` builds nothing (the package then runs its Python path).
A compiler error fails the install: a missing extension is never silent.
"""

import os
import runpy

from setuptools import Extension, setup

_accel = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "protocol", "accel.py"))

if _accel["_flag"](_accel["NO_EXTENSIONS_ENV"]):
    ext_modules = []
else:
    from Cython.Build import cythonize

    ext_modules = cythonize(
        [
            Extension(name, [source], extra_compile_args=["-O2"])
            for name, source in _accel["COMPILED_MODULES"].items()
        ],
        compiler_directives={
            "language_level": 3,
            "annotation_typing": False,  # types come from the .pxd files only: the .py stays Python
            "embedsignature": True,
        },
        quiet=True,
    )

setup(ext_modules=ext_modules)
