"""A dataflow PE-mesh simulator: routers, colors, wavelets, tasks and DSD vector instructions.

Build a program with ``Program`` (regions, symbols, routes, tasks), ``compile()`` it, copy data in
with ``memcpy_h2d``, ``launch`` tasks, ``run()``, and read results with ``memcpy_d2h``. See
``wse_core.fabric.program`` for the machine model and ``_engine.pyx`` for the cycle rules.

Modules, each importing only those named before it: ``isa`` (ports, colors, operands, instructions),
``engine`` (``Engine``: a run you can step; ``Outcome``), ``run`` (``Compiled``: the program as the
engine's arrays, host I/O, ``Result``), ``program`` (``Fabric``, ``Program``: building),
``programs/`` (the reference programs and their registry).
"""
from wse_core.fabric.engine import Engine, Outcome
from wse_core.fabric.isa import FabricError, fin, fout, imm, mem, ops
from wse_core.fabric.program import Fabric, Program
from wse_core.fabric.run import Compiled, Result

__all__ = ["Fabric", "FabricError", "Program", "Compiled", "Result", "Engine", "Outcome", "fin", "fout", "imm", "mem",
           "ops"]
