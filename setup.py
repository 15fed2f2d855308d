"""Build the compiled hot path: Cython compiles the modules listed in
``protocol/accel.py`` (COMPILED_MODULES) from their ``.py`` sources, with the C
types of the ``.pxd`` files beside them. Everything else is in pyproject.toml.

``WHEELD_NO_EXTENSIONS=1`` builds nothing (the package then runs its Python path).
A compiler error fails the install: a missing extension is never silent. A call of
a C function that no header declares is an error too (``-Werror=implicit-function-declaration``):
C would take its result for an ``int``, and a 64-bit value (a hash) would lose half its bits.

Cython finds the ``.pxd`` of a module by its dotted name (``wheeld/shm/wheel.pxd``
for ``wheeld.shm.wheel``), while the sources sit in folders named otherwise
(pyproject's ``package-dir``: ``shm/`` is ``wheeld.shm``). So the build lays the
packages out as installed, as symbolic links under ``build/cython-packages``, and
gives Cython that folder as its include path.
"""

import os
import runpy
import tomllib

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
_accel = runpy.run_path(os.path.join(HERE, "protocol", "accel.py"))


def _package_layout() -> str:
    """``build/cython-packages/wheeld/...``: links to the sources, named as the packages are."""
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    root = os.path.join(HERE, "build", "cython-packages")
    for package, source in sorted(package_dir.items()):  # parents before children
        target = os.path.join(root, *package.split("."))
        os.makedirs(target, exist_ok=True)
        for entry in os.listdir(os.path.join(HERE, source)):
            if entry.endswith((".py", ".pxd")):
                link = os.path.join(target, entry)
                if os.path.lexists(link):
                    os.unlink(link)
                os.symlink(os.path.join(HERE, source, entry), link)
    return root


def _options_changed() -> bool:
    """Cython regenerates a module's C when its sources change, not when the options
    below do: regenerate everything when this file is newer than a generated file."""
    mine = os.path.getmtime(os.path.abspath(__file__))
    for source in _accel["COMPILED_MODULES"].values():
        generated = os.path.join(HERE, os.path.splitext(source)[0] + ".c")
        if not os.path.exists(generated) or os.path.getmtime(generated) < mine:
            return True
    return False


COMPILE_ARGS = ["-O2", "-Werror=implicit-function-declaration"]

if _accel["_flag"](_accel["NO_EXTENSIONS_ENV"]):
    ext_modules = []
else:
    from Cython.Build import cythonize

    ext_modules = cythonize(
        [
            Extension(name, [source], extra_compile_args=COMPILE_ARGS)
            for name, source in _accel["COMPILED_MODULES"].items()
        ],
        include_path=[_package_layout()],
        compiler_directives={
            "language_level": 3,
            "annotation_typing": False,  # types come from the .pxd files only: the .py stays Python
            "embedsignature": True,
        },
        force=_options_changed(),
        quiet=True,
    )

setup(ext_modules=ext_modules)
