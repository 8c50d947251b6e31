"""What the registry holds of a reference program: its function, its command-line options, and the
figures its report adds (``wse fabric run NAME`` is built from these alone)."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    """``--flag`` of ``wse fabric run``, passed to the program as each keyword of ``keywords`` (one
    flag may feed several: ``--tile`` is a tile's rows and columns). ``help`` says what it means for
    this program; programs sharing a flag share its type and default."""
    flag: str
    keywords: tuple
    type: type
    default: object
    help: str


@dataclass(frozen=True)
class Entry:
    """A reference program: ``run(width, height, *, seed, **keywords)`` returns (what the fabric
    computed, numpy's answer, ``Result``); ``report(result, keywords)`` adds figures of its own."""
    name: str
    run: object
    options: tuple = ()
    report: object = None

    def keywords(self, args):
        """The program's keywords from parsed arguments (each option's flag as an attribute)."""
        return {kw: getattr(args, o.flag) for o in self.options for kw in o.keywords}

    def extra(self, result, keywords):
        return self.report(result, keywords) if self.report else {}
