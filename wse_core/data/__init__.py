"""Data-path kernels: HDF5's Fletcher-32, so raw chunk reads are verified as HDF5 would."""
from wse_core.data._kernels import chunk_ok, fletcher32

__all__ = ["chunk_ok", "fletcher32"]
