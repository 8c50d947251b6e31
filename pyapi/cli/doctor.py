"""`wse doctor` and `wse demo`: the two commands that need no files of their own."""
# What a command runs (pyapi.job, pyapi.params, wse_core, data_tools, ...) is imported inside its function:
# `wse --help` imports every module here and must load no numerics (tests/test_cli.py).


def _cmd_doctor(args):
    from pyapi import doctor

    return doctor.main()


def _cmd_demo(args):
    from pyapi import demo

    return demo.main()


def add_doctor(sub, chosen):
    p = sub.add_parser("doctor", help="check the installation and run a 2-rank MPI job",
                       description="Print Python, numpy/BLAS, OpenMP, h5py/HDF5 and MPI versions, "
                                   "then run a 2-rank MPI job through the mpich wheel's mpiexec.")
    p.set_defaults(func=_cmd_doctor)


def add_demo(sub, chosen):
    p = sub.add_parser("demo", help="run the main demo job on built-in defaults",
                       description="Run the main demo job on built-in defaults (no data or config needed).")
    p.set_defaults(func=_cmd_demo)
