"""The layers of the house (docs/design.md section 1): every import points down, and none goes round.

Imports are read from the source with ``ast``, those inside functions included (a lazy import is
still a dependency). ``from package import name`` depends on the submodule ``package.name`` when
there is one, else on the package itself; a module's implicit import of its parent packages is not
counted (Python's own machinery, not a choice of ours).
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Each layer may import the layers below it, never one above; wse_core and data_tools are the
#: bottom two (data_tools reads wse_core's checksum kernel and models).
LAYERS = ("wse_core", "data_tools", "mpi_launch", "pyapi", "bench")


def modules():
    found = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        for path in sorted((ROOT / layer).rglob("*.pyx")):  # compiled modules import nothing of ours
            found.setdefault(".".join(path.relative_to(ROOT).with_suffix("").parts), None)
    return found


def imports_of(name, path, known):
    """The project modules ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph():
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items() if path is not None}


def test_no_module_imports_a_layer_above_its_own():
    """wse_core < data_tools < mpi_launch < pyapi < bench: the ranks never read the user surface, and
    `wse bench` is the bench package's command, plugged into the command line (pyapi.cli.PLUGINS)."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = sorted(f"{a} -> {b}" for a, targets in graph().items() for b in targets
                    if rank[b.split(".")[0]] > rank[a.split(".")[0]])
    assert not upward, upward


def test_no_import_cycles():
    """No module reaches itself through the modules it imports (Tarjan's strongly connected components)."""
    edges, index, low, stack, on_stack, cycles = graph(), {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, cycles


#: The floors inside each package, bottom first: a package's sub-package or module (its name's second
#: part) may import those on floors below its own, never one beside or above it (docs/design.md section 1).
FLOORS = {
    "wse_core": [{"errors", "numerics", "_openmp", "data"}, {"checks", "microbatch", "fabric"},
                 {"optim", "sparse"}, {"nn"}, {"perf"}, {"compiler"}, {"models"}],
    "data_tools": [{"errors", "files"}, {"checkpoint", "documents", "lmdata"}, {"tokenizers"},
                   {"dataset", "hf", "preprocess"}],
    "mpi_launch": [{"hello", "mpiexec", "plan", "protocol", "spec"}, {"messaging", "resolved", "supervisor"},
                   {"rundir", "watchdog"}, {"launcher"}, {"inference", "roles"}, {"run"}],
    "pyapi": [{"doctor", "errors", "generate", "modelzoo", "openai_api", "plot"}, {"client", "params", "serve"},
              {"job"}, {"appliance", "cstorch", "demo"}, {"cli"}],
}


def test_every_module_is_on_a_floor_and_imports_only_the_floors_below():
    floor_of = {f"{package}.{name}": i for package, floors in FLOORS.items() for i, names in enumerate(floors)
                for name in names}
    edges, unplaced = set(), set()
    for a, targets in graph().items():
        for b in targets:
            package = a.split(".")[0]
            if package not in FLOORS or b.split(".")[0] != package or a == package or b == package:
                continue  # another package's (the layers above), or a package's own __init__
            sa, sb = (".".join(m.split(".")[:2]) for m in (a, b))
            unplaced |= {s for s in (sa, sb) if s not in floor_of}
            if sa != sb and sa in floor_of and sb in floor_of \
                    and floor_of[sa] <= floor_of[sb]:
                edges.add(f"{a} -> {b}")
    modules_here = {".".join(m.split(".")[:2]) for m in modules() if m.split(".")[0] in FLOORS and "." in m}
    assert not unplaced and modules_here <= set(floor_of), sorted(unplaced | (modules_here - set(floor_of)))
    assert not edges, sorted(edges)
