"""HDF5 data: dataset preprocessing, sharded loaders, the checkpoint store, inspect and verify."""

# Here rather than in lmdata so that the command line can offer them without importing h5py.
COMPRESSIONS = ("gzip", "lzf", "none")
DEFAULT_COMPRESSION = "none"  # measured by `wse bench input`: see docs/design/data.md "Compression"
