"""The reference programs for the PE mesh, one module each with its numpy reference, and their
registry: ``PROGRAMS`` (name -> ``Entry``: the function, its ``wse fabric run`` options, its report's
extra figures), from which the command line builds ``wse fabric run NAME`` and its options.

A new program is a module here ending in ``PROGRAM = Entry(...)``, listed once below.
"""
from wse_core.fabric.programs import allreduce, bicgstab, broadcast, gemv, spmv, stencil7, stream_gemm
from wse_core.fabric.programs.entry import Entry, Option

#: Every reference program by name, in the order ``wse fabric run --help`` lists them.
PROGRAMS = {m.PROGRAM.name: m.PROGRAM for m in (stencil7, broadcast, allreduce, gemv, spmv, stream_gemm, bicgstab)}


def options():
    """{flag: (type, default, help)} of every program's options, in the order they first appear; the
    help names the programs of each meaning ("stencil7, bicgstab: points along z ...")."""
    merged, meanings = {}, {}
    for entry in PROGRAMS.values():
        for o in entry.options:
            if merged.setdefault(o.flag, (o.type, o.default)) != (o.type, o.default):
                raise ValueError(f"--{o.flag}: {entry.name} gives it another type or default than an earlier program")
            meanings.setdefault(o.flag, {}).setdefault(o.help, []).append(entry.name)
    return {flag: (*merged[flag], "; ".join(f"{', '.join(names)}: {text}" for text, names in meanings[flag].items()))
            for flag in merged}


__all__ = ["PROGRAMS", "Entry", "Option", "options"]
