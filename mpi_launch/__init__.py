"""The cluster: rank plan, roles (coordinator, MemoryX, SwarmX, CS-2, input worker), the mpiexec
command, the run directory and the watchdog that ends a job at its first fault."""
from mpi_launch.mpiexec import MPILaunchError, find_mpiexec, run_mpi

__all__ = ["MPILaunchError", "find_mpiexec", "run_mpi"]
