"""The cluster: rank plan, roles (coordinator, MemoryX, SwarmX, CS-2, input worker) and the mpiexec launcher."""
from mpi_launch.launcher import MPILaunchError, find_mpiexec, run_mpi

__all__ = ["MPILaunchError", "find_mpiexec", "run_mpi"]
