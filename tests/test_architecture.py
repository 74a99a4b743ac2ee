"""The import structure of gdn, read from the source with ``ast`` (no imports run):

* a kernel module (``gdn.kernels.*``) imports only other kernel modules and the leaf modules ``gdn.config`` /
  ``gdn.backend`` — never ``gdn.ops``, ``gdn.layers``, ``gdn.distributed``, ...;
* no cycle between gdn's subpackages (``layers`` imports ``distributed``, never the reverse), counting function-local
  imports too.
"""
import ast
import os

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
KERNEL_MAY_IMPORT = {"gdn.kernels", "gdn.config", "gdn.backend"}


def _module_name(path):
    rel = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path):
    """Every gdn module named by an import statement anywhere in the file (relative imports resolved)."""
    name = _module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)   # "from . import tuning" names a module
    return {m for m in out if m == "gdn" or m.startswith("gdn.")}


def _modules():
    mods = {}
    for root, _, files in os.walk(os.path.join(SRC, "gdn")):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(root, f)
                mods[_module_name(p)] = _imports(p)
    return mods


def _subpackage(mod):
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def _under(mod, prefix):
    return mod == prefix or mod.startswith(prefix + ".")


def test_kernel_modules_import_only_kernels_and_leaves():
    bad = []
    for mod, imps in _modules().items():
        if _under(mod, "gdn.kernels"):
            for imp in imps:
                if imp != "gdn" and not any(_under(imp, ok) for ok in KERNEL_MAY_IMPORT):
                    bad.append(f"{mod} imports {imp}")
    assert not bad, "kernel modules must not import the layers above them:\n" + "\n".join(sorted(bad))


def _subpackage_graph(mods):
    graph = {}
    for mod, imps in mods.items():
        a = _subpackage(mod)
        for imp in imps:
            b = _subpackage(imp)
            if a and b and a != b and b in {_subpackage(m) for m in mods}:
                graph.setdefault(a, set()).add(b)
    return graph


def _cycle(graph):
    """One cycle of the directed graph as a list of nodes, or None."""
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_cycle_between_subpackages():
    cyc = _cycle(_subpackage_graph(_modules()))
    assert cyc is None, "import cycle between gdn subpackages: " + " -> ".join(cyc)


def test_layers_import_distributed_one_way():
    graph = _subpackage_graph(_modules())
    assert "layers" not in graph.get("distributed", set())
    assert "ops" not in graph.get("kernels", set())


def test_the_checks_would_fail():
    """The checker finds a planted cycle and a planted upward import."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    tree = {"gdn.kernels.x": {"gdn.ops"}}
    assert any(not any(_under(i, ok) for ok in KERNEL_MAY_IMPORT) for i in tree["gdn.kernels.x"])


@pytest.mark.parametrize("path,expect", [("gdn/kernels/chunk/state.py", "gdn.kernels.tuning"),
                                         ("gdn/kernels/chunk/backward/reverse.py", "gdn.kernels.chunk.plan")])
def test_relative_imports_resolve(path, expect):
    assert expect in _imports(os.path.join(SRC, path))


def test_kernels_launch_through_gdn_launch():
    """No ``kernel[grid](...)`` outside ``gdn.kernels.launch`` (and the AOT recorder): every launch goes through
    ``gdn.kernels.launch.launch``, whose key the launch tests check against each Triton release."""
    found = []
    for root, _, files in os.walk(os.path.join(SRC, "gdn")):
        for f in files:
            path = os.path.join(root, f)
            if not f.endswith(".py") or _module_name(path) in ("gdn.kernels.launch", "gdn.aot"):
                continue
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and \
                        ast.unparse(node.func.value).endswith("kernel"):
                    found.append(f"{_module_name(path)}:{node.lineno}: {ast.unparse(node.func)}")
    assert not found, found
    launches = open(os.path.join(SRC, "gdn", "kernels", "chunk", "hopper.py")).read().count("launch(")
    assert launches >= 2   # the test reads the files it means to (the Gluon launchers call launch)
