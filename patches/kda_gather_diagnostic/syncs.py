"""What can make the host wait for the GPU stream, read from the AST, and what counts as the
K3_KDA_GATHER_LOG gate. classify uses it to spot a diagnostic in a form k3patch does not know;
the probe uses it to prove that every such call sits behind the gate."""

from __future__ import annotations

import ast
from collections.abc import Iterator

ENV = "K3_KDA_GATHER_LOG"

SYNC_METHODS = frozenset(
    {"item", "tolist", "cpu", "numpy", "nonzero", "masked_select", "unique", "argwhere"}
    | {"unique_consecutive"}
)
SYNC_TORCH_FUNCTIONS = SYNC_METHODS | {"equal", "allclose", "is_nonzero"}
SCALAR_CASTS = frozenset({"bool", "int", "float"})
# A tensor reduction used as a truth value is an implicit bool().
TRUTH_REDUCTIONS = frozenset({"any", "all"})
HOST_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "is_xpu", "layout"})
HOST_METHODS = frozenset(
    {"numel", "nelement", "size", "stride", "dim", "element_size", "is_contiguous", "data_ptr"}
)


def _is_host_value(node: ast.expr) -> bool:
    """Whether `node` is certainly a host value (tensor metadata or a literal), never a tensor."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Attribute):
        return node.attr in HOST_ATTRIBUTES
    if isinstance(node, ast.Subscript):
        return _is_host_value(node.value)
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name):
            return func.id == "len"
        return isinstance(func, ast.Attribute) and func.attr in HOST_METHODS
    if isinstance(node, ast.BinOp):
        return _is_host_value(node.left) and _is_host_value(node.right)
    if isinstance(node, ast.UnaryOp):
        return _is_host_value(node.operand)
    return False


def _is_mask(node: ast.expr) -> bool:
    """An index expression that is a boolean tensor: indexing with it sizes its output on host."""
    if isinstance(node, ast.Tuple):
        return any(_is_mask(e) for e in node.elts)
    if isinstance(node, ast.Compare):
        return not all(_is_host_value(e) for e in (node.left, *node.comparators))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr | ast.BitAnd | ast.BitXor):
        return True
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert)


def _walk_code(root: ast.AST) -> Iterator[ast.AST]:
    """Every node under `root` that runs as code: annotations (where `A | B` and `x[...]` mean
    types, not tensors) are left out."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        for name, value in ast.iter_fields(node):
            if name not in ("returns", "annotation") and not isinstance(value, ast.arguments):
                children = value if isinstance(value, list) else [value]
                stack.extend(c for c in children if isinstance(c, ast.AST))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            args = node.args
            stack.extend(d for d in [*args.defaults, *args.kw_defaults] if d is not None)


def _truth_tests(node: ast.AST) -> list[ast.expr]:
    """The expressions that `node` itself uses as truth values."""
    if isinstance(node, ast.If | ast.While | ast.IfExp | ast.Assert):
        return [node.test]
    if isinstance(node, ast.BoolOp):
        return node.values
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return [node.operand]
    return node.ifs if isinstance(node, ast.comprehension) else []


def sync_points(root: ast.AST) -> list[tuple[ast.AST, str]]:
    """Every expression under `root` that can make the host wait for the GPU, with its kind."""
    found: list[tuple[ast.AST, str]] = []
    for node in _walk_code(root):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in SCALAR_CASTS:
                if node.args and not _is_host_value(node.args[0]):
                    found.append((node, f"{func.id}() of a tensor"))
            elif isinstance(func, ast.Attribute):
                torch_call = isinstance(func.value, ast.Name) and func.value.id == "torch"
                if torch_call and func.attr in SYNC_TORCH_FUNCTIONS:
                    found.append((node, f"torch.{func.attr}()"))
                elif not torch_call and func.attr in SYNC_METHODS:
                    found.append((node, f".{func.attr}()"))
        elif isinstance(node, ast.Subscript) and _is_mask(node.slice):
            found.append((node, "boolean-mask indexing"))
    for test in (test for node in _walk_code(root) for test in _truth_tests(node)):
        called = test.func if isinstance(test, ast.Call) else None
        if isinstance(called, ast.Attribute) and called.attr in TRUTH_REDUCTIONS:
            found.append((test, f"truth value of .{called.attr}()"))
    return found


def _constant(node: ast.expr, otherwise: object = None) -> object:
    return node.value if isinstance(node, ast.Constant) else otherwise


def is_gate(test: ast.expr) -> bool:
    """`<os>.environ.get("K3_KDA_GATHER_LOG"[, default]) == "1"` or the same through `getenv`,
    default not "1": a test that reads only the environment, so nothing on the device runs
    before it decides, and that is off when the variable is unset."""
    if not (
        isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
    ):
        return False
    call = test.left
    if not (
        _constant(test.comparators[0]) == "1"
        and isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.args
        and _constant(call.args[0]) == ENV
    ):
        return False
    # A default of "1" (or one that is not a constant) could make the unset variable read as on,
    # whether it is passed by position or as `default=`; any other keyword is not a gate we know.
    defaults = call.args[1:] + [k.value for k in call.keywords if k.arg == "default"]
    if len(defaults) > 1 or any(k.arg != "default" for k in call.keywords):
        return False
    if defaults and _constant(defaults[0], "1") == "1":
        return False
    owner = call.func.value
    if call.func.attr == "getenv":
        return isinstance(owner, ast.Name)
    return (
        call.func.attr == "get"
        and isinstance(owner, ast.Attribute)
        and owner.attr == "environ"
        and isinstance(owner.value, ast.Name)
    )


def ungated_sync_points(func: ast.AST) -> tuple[list[str], list[str]]:
    """(gated, ungated) sync points of `func`, each as 'kind at line N'. A point is gated when it
    sits in the body of an `if` whose test is the K3_KDA_GATHER_LOG gate."""
    gates = [n for n in ast.walk(func) if isinstance(n, ast.If) and is_gate(n.test)]
    inside = {id(n) for gate in gates for stmt in gate.body for n in ast.walk(stmt)}
    gated: list[str] = []
    ungated: list[str] = []
    for node, kind in sync_points(func):
        where = f"{kind} at line {getattr(node, 'lineno', '?')}"
        (gated if id(node) in inside else ungated).append(where)
    return gated, ungated
