"""Build the Cython kernels of wse_core with -O3 and OpenMP.

OpenMP is probed with the compiler that will build the extensions. Without it the build still
succeeds (every ``prange`` becomes a serial loop), says so loudly here, and ``wse doctor`` and
``import wse_core`` say so again at run time.

Where the building machine runs AVX2 (a probe program asks the CPU), the kernels are built for it,
with ``-ffp-contract=off`` so no multiply-add is fused: every operation rounds as in the SSE2 build,
so the bits are the same, 8 lanes at a time instead of 4 (GELU's forward 2.3x faster, measured). The
extensions then need an AVX2 CPU, as the machine that built them has.

Environment switches:
  WSE_NO_OPENMP=1     build without OpenMP even if the compiler supports it
  WSE_NO_AVX2=1       build for any x86-64 (SSE2) even on an AVX2 machine
  WSE_CYTHON_DEBUG=1  turn bounds checks and wraparound back on (slow; for debugging kernels)
"""
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent
OPENMP_FLAG = "-fopenmp"
# -fno-math-errno lets gcc vectorise sqrt, and -fno-trapping-math lets it turn the branches of
# wse_math.h into selects; neither changes a result (only errno and floating-point trap flags,
# which nothing here reads). No -ffast-math: it would reorder sums and change bits.
BASE_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math"]

AVX2_FLAGS = ["-mavx2", "-ffp-contract=off"]
AVX2_PROBE = r"""
int main(void) { __builtin_cpu_init(); return __builtin_cpu_supports("avx2") ? 0 : 1; }
"""

OMP_PROBE = r"""
#include <omp.h>
int main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }
"""


#: The flags each kernel in the source tree was last built with: a later install that would build it
#: again with the same flags from the same sources keeps it (see BuildExtWithOpenMP.build_extension).
STAMP = ROOT / "build" / "kernels.json"


class BuildExtWithOpenMP(build_ext):
    """build_ext that adds -O3 everywhere and -fopenmp where the compiler supports it, compiles the
    kernels in parallel, and keeps a kernel already built from the same sources with the same flags."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def build_extensions(self):
        use_openmp = os.environ.get("WSE_NO_OPENMP", "") in ("", "0") and self._compiler_has_openmp()
        use_avx2 = os.environ.get("WSE_NO_AVX2", "") in ("", "0") and self._runs(AVX2_PROBE, AVX2_FLAGS)
        flags = BASE_FLAGS + ([OPENMP_FLAG] if use_openmp else []) + (AVX2_FLAGS if use_avx2 else [])
        for ext in self.extensions:
            ext.extra_compile_args = flags + list(ext.extra_compile_args)
            if use_openmp:
                ext.extra_link_args = [OPENMP_FLAG] + list(ext.extra_link_args)
        if not use_openmp:
            bar = "!" * 78
            sys.stderr.write(
                f"\n{bar}\n!! wse-cluster: building WITHOUT OpenMP: every kernel will run on ONE thread.\n"
                f"!! (the compiler could not build an OpenMP program, or WSE_NO_OPENMP is set)\n{bar}\n\n"
            )
        self._stamp = json.loads(STAMP.read_text()) if STAMP.exists() else {}
        super().build_extensions()
        STAMP.parent.mkdir(exist_ok=True)
        STAMP.write_text(json.dumps(self._stamp, indent=1, sort_keys=True))

    def build_extension(self, ext):
        # pip builds again for every install of the project, even `pip install -e '.[serve]'` to add an
        # extra, in a fresh temporary directory and a fresh Cython (whose newer files make cythonize
        # write every .c again): without this each one compiled every kernel again. So what decides is
        # the content of the kernel's C source and headers and its flags, not the files' times.
        built = ROOT / self.get_ext_filename(ext.name)  # where the editable install imports it from
        inputs = sorted({ROOT / s for s in ext.sources} | set(ROOT.glob("wse_core/**/*.h")))
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in inputs)).hexdigest()
        key = {"flags": ext.extra_compile_args + ext.extra_link_args, "sha256": digest}
        if self._stamp.get(ext.name) == key and built.exists() and not self.force:
            target = Path(self.get_ext_fullpath(ext.name))
            if target.resolve() != built.resolve():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(built, target)
            print(f"wse-cluster: {ext.name} is up to date (built from this C source with these flags)")
            return
        super().build_extension(ext)
        self._stamp[ext.name] = key

    def _compiler_has_openmp(self):
        from setuptools.errors import CompileError, LinkError

        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "omp_probe.c"
            src.write_text(OMP_PROBE)
            try:
                objs = self.compiler.compile([str(src)], output_dir=tmp, extra_postargs=[OPENMP_FLAG])
                self.compiler.link_executable(objs, "omp_probe", output_dir=tmp, extra_postargs=[OPENMP_FLAG])
            except (CompileError, LinkError):
                return False
        return True

    def _runs(self, program, flags):
        """Whether ``program`` compiles with ``flags`` and exits 0 on this machine."""
        import subprocess

        from setuptools.errors import CompileError, LinkError

        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "probe.c"
            src.write_text(program)
            try:
                objs = self.compiler.compile([str(src)], output_dir=tmp, extra_postargs=flags)
                self.compiler.link_executable(objs, "probe", output_dir=tmp)
            except (CompileError, LinkError):
                return False
            return subprocess.run([str(Path(tmp) / "probe")], check=False).returncode == 0


def extensions():
    debug = os.environ.get("WSE_CYTHON_DEBUG", "") not in ("", "0")
    exts = []
    for pyx in sorted(ROOT.glob("wse_core/**/*.pyx")):
        rel = pyx.relative_to(ROOT)
        name = ".".join(rel.with_suffix("").parts)
        exts.append(Extension(name, [str(rel)], include_dirs=["wse_core", str(rel.parent)]))
    return cythonize(
        exts,
        nthreads=os.cpu_count() or 1,
        compiler_directives={
            "language_level": 3,
            "boundscheck": debug,
            "wraparound": debug,
            "initializedcheck": debug,
            "cdivision": True,
        },
    )


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExtWithOpenMP})
