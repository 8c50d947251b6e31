"""A dataflow PE-mesh simulator: routers, colors, wavelets, tasks and DSD vector instructions.

Build a program with ``Program`` (regions, symbols, routes, tasks), ``compile()`` it, copy data in
with ``memcpy_h2d``, ``launch`` tasks, ``run()``, and read results with ``memcpy_d2h``. See
``wse_core.fabric.program`` for the machine model and ``_engine.pyx`` for the cycle rules.
"""
from wse_core.fabric.program import Fabric, FabricError, Program, fin, fout, imm, mem, ops
from wse_core.fabric.run import Compiled, Result

__all__ = ["Fabric", "FabricError", "Program", "Compiled", "Result", "fin", "fout", "imm", "mem", "ops"]
