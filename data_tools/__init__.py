"""HDF5 data: dataset preprocessing, sharded loaders, the checkpoint store, inspect and verify."""
