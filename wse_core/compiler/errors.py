"""The compiler's error, and how its one-line messages name a graph node: module path, op, source line."""
from wse_core.errors import ConfigError


class CompileError(ConfigError):
    """A model, loss or batch the compiler refuses; the message names the module path and the op. A
    ConfigError: the model is the user's code, to change (a ValueError, as before)."""


def module_of(node):
    """(path, class name) of the innermost module that ran an fx node; ("step", "Step") for the
    Step's own ops (a loss given as a plain function)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "step", "Step"
    path, cls = list(stack.values())[-1]
    cls = cls if isinstance(cls, str) else cls.__qualname__
    return (path or "step"), cls.rsplit(".", 1)[-1]


def op_name(node):
    """"aten.nonzero" for a node calling torch.ops.aten.nonzero.default."""
    name = getattr(node.target, "name", None)
    return name().split(".")[0].replace("::", ".") if callable(name) else str(node.target)


def source_line(stack_trace):
    """``file:line `code``` of the innermost frame of an fx node's ``stack_trace``, or "an unknown place"."""
    lines = (stack_trace or "").rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        text = lines[i].strip()
        if text.startswith("File "):
            parts = text.split('"')
            file = parts[1].rsplit("/", 1)[-1] if len(parts) > 2 else "?"
            line = text.split("line ")[-1].split(",")[0]
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{file}:{line} `{code}`"
    return "an unknown place"
