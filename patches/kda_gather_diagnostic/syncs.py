"""What can make the host wait for the GPU stream, read from the AST, and what counts as the
K3_KDA_GATHER_LOG gate. classify uses it to spot a diagnostic in a form k3patch does not know;
the probe uses it to prove that every such call sits behind the gate."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from k3patch.model import parent_map

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
            if name in ("returns", "annotation") or isinstance(value, ast.arguments):
                continue
            children = value if isinstance(value, list) else [value]
            stack.extend(c for c in children if isinstance(c, ast.AST))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            stack.extend(node.args.defaults)
            stack.extend(d for d in node.args.kw_defaults if d is not None)


def _truth_tests(root: ast.AST) -> Iterator[ast.expr]:
    for node in _walk_code(root):
        if isinstance(node, ast.If | ast.While | ast.IfExp | ast.Assert):
            yield node.test
        elif isinstance(node, ast.BoolOp):
            yield from node.values
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield node.operand
        elif isinstance(node, ast.comprehension):
            yield from node.ifs


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
    for test in _truth_tests(root):
        if (
            isinstance(test, ast.Call)
            and isinstance(test.func, ast.Attribute)
            and test.func.attr in TRUTH_REDUCTIONS
        ):
            found.append((test, f"truth value of .{test.func.attr}()"))
    return found


def is_gate(test: ast.expr) -> bool:
    """`<os>.environ.get("K3_KDA_GATHER_LOG"[, default]) == "1"` or the same through `getenv`,
    default not "1": a test that reads only the environment, so nothing on the device runs
    before it decides, and that is off when the variable is unset."""
    if not (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Eq)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "1"
        and isinstance(test.left, ast.Call)
        and test.left.args
        and isinstance(test.left.args[0], ast.Constant)
        and test.left.args[0].value == ENV
    ):
        return False
    # A default of "1" would make the unset variable read as on.
    default = test.left.args[1] if len(test.left.args) > 1 else None
    if default is not None and not (isinstance(default, ast.Constant) and default.value != "1"):
        return False
    func = test.left.func
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr == "getenv":
        return isinstance(func.value, ast.Name)
    return (
        func.attr == "get"
        and isinstance(func.value, ast.Attribute)
        and func.value.attr == "environ"
        and isinstance(func.value.value, ast.Name)
    )


def ungated_sync_points(func: ast.AST) -> tuple[list[str], list[str]]:
    """(gated, ungated) sync points of `func`, each as 'kind at line N'. A point is gated when it
    sits in the body of an `if` whose test is the K3_KDA_GATHER_LOG gate."""
    parents = parent_map(func)
    gated: list[str] = []
    ungated: list[str] = []
    for node, kind in sync_points(func):
        where = f"{kind} at line {getattr(node, 'lineno', '?')}"
        child: ast.AST = node
        parent = parents.get(id(child))
        inside = False
        while parent is not None:
            if isinstance(parent, ast.If) and is_gate(parent.test) and child in parent.body:
                inside = True
                break
            child, parent = parent, parents.get(id(parent))
        (gated if inside else ungated).append(where)
    return gated, ungated
