"""The machine's vocabulary: ports, colors, DSD operands and vector instructions, and the error a
program that cannot run raises. The builder (``program``), the compiler (``run``) and the engine
(``_engine.pyx``, which repeats the operand kinds and opcodes) share it, so it imports none of them.
"""
from dataclasses import dataclass, replace

from wse_core.errors import ConfigError

PORTS = {"N": 0, "E": 1, "S": 2, "W": 3, "RAMP": 4}
NUM_COLORS = 24
MAX_TASKS = 32

# Operand kinds and opcodes shared with _engine.pyx.
K_NONE, K_MEM, K_FIN, K_FOUT, K_IMM, K_IDX = range(6)
OPCODES = {"FMOV": 0, "FADD": 1, "FSUB": 2, "FMUL": 3, "FMAC": 4, "FNEG": 5, "FMAX": 6, "FDIV": 7,
           "ACTIVATE": 8, "BLOCK": 9, "UNBLOCK": 10}
DTYPES = ("float32", "int32")


class FabricError(ConfigError):
    """A program that cannot run as written; the message names the PE (x, y), color or task. A
    ConfigError: the program is what its user wrote and changes (a ValueError, as before)."""



@dataclass(frozen=True)
class Symbol:
    name: str
    length: int
    dtype: str = "float32"


@dataclass(frozen=True)
class Operand:
    kind: int
    arg: object = None       # Symbol (mem), color (fin/fout), value (imm)
    offset: int = 0
    length: int = 0
    stride: int = 1
    index: "Operand" = None  # indexed memory DSD: the int32 memory DSD of the indices


def mem(symbol, offset=0, length=None, stride=1, *, index=None):
    """Memory DSD: ``length`` elements of ``symbol`` from ``offset``, ``stride`` apart; with
    ``index=mem(idx, ...)`` (an int32 symbol), element e is ``symbol[offset + idx[e]]`` instead."""
    if not isinstance(symbol, Symbol):
        raise FabricError(f"mem: expected a symbol from Program.alloc, got {symbol!r}")
    if index is not None:
        if not (isinstance(index, Operand) and index.kind == K_MEM and index.index is None
                and index.arg.dtype == "int32"):
            raise FabricError(f"mem({symbol.name!r}, index=...): expected a memory DSD of an int32 symbol")
        return Operand(K_IDX, symbol, offset, index.length, 1, index)
    if length is None:
        length = (symbol.length - offset + stride - 1) // stride
    return Operand(K_MEM, symbol, offset, length, stride)


def fin(color, length):
    """Fabric input DSD: the next ``length`` wavelets of ``color`` arriving at this core."""
    return Operand(K_FIN, color, 0, length)


def fout(color, length):
    """Fabric output DSD: ``length`` wavelets of ``color`` sent from this core into its router."""
    return Operand(K_FOUT, color, 0, length)


def imm(value):
    """A scalar operand (the same value for every element)."""
    return Operand(K_IMM, float(value))


@dataclass(frozen=True)
class Instr:
    op: str
    dst: Operand = None
    a: Operand = None
    b: Operand = None
    task: str = None
    is_async: bool = False

    def asynchronous(self, then=None):
        """Run on one of the PE's 4 microthreads while the task goes on (the SDK's async DSD ops);
        ``then``: a task of this PE to activate when the instruction has processed every element."""
        return replace(self, is_async=True, task=then)


class ops:
    """The instruction set: d = a (FMOV), a + b, a - b, a * b, d = d + a * b (FMAC), -a, max(a, b),
    a / b (FDIV, for the scalars of solvers: IEEE float32, x / 0 is inf or nan);
    ACTIVATE/BLOCK/UNBLOCK a task of the same PE. A memory operand with stride 0 is a scalar (the
    same word for every element); ``imm(v)`` a constant. ``.asynchronous(then=...)`` runs a vector
    instruction on a microthread."""

    @staticmethod
    def FMOV(d, a):
        return Instr("FMOV", d, a)

    @staticmethod
    def FADD(d, a, b):
        return Instr("FADD", d, a, b)

    @staticmethod
    def FSUB(d, a, b):
        return Instr("FSUB", d, a, b)

    @staticmethod
    def FMUL(d, a, b):
        return Instr("FMUL", d, a, b)

    @staticmethod
    def FMAC(d, a, b):
        return Instr("FMAC", d, a, b)

    @staticmethod
    def FNEG(d, a):
        return Instr("FNEG", d, a)

    @staticmethod
    def FMAX(d, a, b):
        return Instr("FMAX", d, a, b)

    @staticmethod
    def FDIV(d, a, b):
        return Instr("FDIV", d, a, b)

    @staticmethod
    def ACTIVATE(task):
        return Instr("ACTIVATE", task=task)

    @staticmethod
    def BLOCK(task):
        return Instr("BLOCK", task=task)

    @staticmethod
    def UNBLOCK(task):
        return Instr("UNBLOCK", task=task)


