"""The wafer: compiled performance core of wse-cluster (Cython + OpenMP) and its thin wrappers."""
import warnings

from wse_core._openmp import openmp_info

if not openmp_info()["openmp"]:
    warnings.warn(
        "wse_core was built without OpenMP: every kernel runs on one thread "
        "(reinstall with a compiler that supports -fopenmp; see `wse doctor`)",
        RuntimeWarning,
        stacklevel=2,
    )

__all__ = ["openmp_info"]
