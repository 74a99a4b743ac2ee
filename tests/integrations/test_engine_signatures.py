"""The engine entry points have the signatures of the engines' own functions (names, order, kinds, defaults).

The engines' sources are read with ``ast`` (never imported or installed) from ``$GDN_ENGINE_SRC`` (default
``~/.cache/gdn/engine_src``), which ``scripts/engine_sources.sh`` fills from the wheels; where they are absent (no
network), the committed snapshot ``engine_signatures.json`` (written by ``scripts/engine_sources.sh --snapshot``) is
compared instead, so the shims are always checked against something the engines published.

    python tests/integrations/test_engine_signatures.py --files      # the files to unpack (for the script)
    python tests/integrations/test_engine_signatures.py --snapshot   # rewrite the snapshot from $GDN_ENGINE_SRC
"""
import ast
import importlib
import inspect
import json
import os
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
SNAPSHOT = HERE / "engine_signatures.json"
ENGINES = {  # engine -> (version, gdn module, {function: source file inside the wheel})
    "vllm": ("0.33.0", "gdn.integrations.vllm", {
        "chunk_gated_delta_rule": "vllm/third_party/flash_linear_attention/ops/chunk.py",
        "fused_recurrent_gated_delta_rule": "vllm/third_party/flash_linear_attention/ops/fused_recurrent.py",
        "fused_recurrent_gated_delta_rule_packed_decode":
            "vllm/third_party/flash_linear_attention/ops/fused_recurrent.py",
        "fused_sigmoid_gating_delta_rule_update": "vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py",
    }),
    "sglang": ("0.5.23", "gdn.integrations.sglang", {
        "chunk_gated_delta_rule": "sglang/kernels/ops/attention/fla/chunk.py",
        "fused_sigmoid_gating_delta_rule_update":
            "sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py",
        "fused_recurrent_gated_delta_rule_packed_decode": "sglang/kernels/ops/attention/fla/fused_recurrent.py",
    }),
}
_KIND = {"positional": "POSITIONAL_OR_KEYWORD", "kwonly": "KEYWORD_ONLY"}


def source_dir():
    d = os.environ.get("GDN_ENGINE_SRC") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                         os.path.expanduser("~/.cache"), "gdn", "engine_src")
    return pathlib.Path(d)


def parse_signature(path: pathlib.Path, name: str):
    """[[name, kind, default source or None], ...] of the top-level function ``name`` in ``path`` (via ast)."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            a = node.args
            pos = a.posonlyargs + a.args
            defaults = [None] * (len(pos) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
            out = [[p.arg, "positional", d] for p, d in zip(pos, defaults)]
            out += [[p.arg, "kwonly", None if d is None else ast.unparse(d)] for p, d in zip(a.kwonlyargs,
                                                                                           a.kw_defaults)]
            if a.vararg or a.kwarg:
                out.append(["*", "var", None])
            return out
    raise LookupError(f"{name} not found in {path}")


def real_signatures():
    """{(engine, function): params} from the unpacked sources, for the functions whose file is there."""
    root = source_dir()
    found = {}
    for eng, (_, _, funcs) in ENGINES.items():
        for fn, rel in funcs.items():
            if (root / rel).is_file():
                found[(eng, fn)] = parse_signature(root / rel, fn)
    return found


def snapshot_signatures():
    data = json.loads(SNAPSHOT.read_text())
    return {(eng, fn): spec["params"] for eng, e in data["engines"].items() for fn, spec in e["functions"].items()}


def assert_same(eng: str, fn: str, params):
    shim = getattr(importlib.import_module(ENGINES[eng][1]), fn)
    got = list(inspect.signature(shim).parameters.values())
    assert [p.name for p in got] == [p[0] for p in params], f"{eng}.{fn}: argument names/order differ"
    for p, (name, kind, default) in zip(got, params):
        assert p.kind.name == _KIND[kind], f"{eng}.{fn}({name}): kind {p.kind.name}, engine {kind}"
        if default is None:
            assert p.default is inspect.Parameter.empty, f"{eng}.{fn}({name}): the engine has no default"
        else:
            assert p.default is not inspect.Parameter.empty and p.default == ast.literal_eval(default), \
                f"{eng}.{fn}({name}): default {p.default!r}, engine {default}"


CASES = [(eng, fn) for eng, (_, _, funcs) in ENGINES.items() for fn in funcs]


@pytest.mark.parametrize("eng,fn", CASES)
def test_signature_matches_engine(eng, fn):
    """Against the engine's unpacked source when there, else against the committed snapshot of it."""
    real = real_signatures()
    params = real.get((eng, fn)) or snapshot_signatures()[(eng, fn)]
    assert_same(eng, fn, params)


def test_snapshot_is_current():
    """The snapshot holds every function, and equals the unpacked sources wherever those are present."""
    snap = snapshot_signatures()
    assert set(snap) == set(CASES)
    for key, params in real_signatures().items():
        assert snap[key] == params, f"{key}: engine_signatures.json is stale (scripts/engine_sources.sh --snapshot)"


def test_parse_signature(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f(a, b: int = 2, *, c=None, d=1.5):\n    pass\n")
    assert parse_signature(f, "f") == [["a", "positional", None], ["b", "positional", "2"], ["c", "kwonly", "None"],
                                       ["d", "kwonly", "1.5"]]
    with pytest.raises(LookupError):
        parse_signature(f, "g")


def _write_snapshot():
    real = real_signatures()
    missing = [k for k in CASES if k not in real]
    if missing:
        raise SystemExit(f"engine sources missing under {source_dir()}: {missing}")
    data = {"about": "vLLM / SGLang GDN entry point signatures, parsed from the engines' wheels by "
                     "scripts/engine_sources.sh --snapshot", "engines": {}}
    for eng, (ver, _, funcs) in ENGINES.items():
        data["engines"][eng] = {"version": ver, "functions": {
            fn: {"file": rel, "params": real[(eng, fn)]} for fn, rel in funcs.items()}}
    SNAPSHOT.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--files"]:
        print(" ".join(sorted({rel for _, _, funcs in ENGINES.values() for rel in funcs.values()})))
    elif sys.argv[1:] == ["--snapshot"]:
        _write_snapshot()
    else:
        raise SystemExit(__doc__)
