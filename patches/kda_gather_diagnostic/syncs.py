"""What can make the host wait for the GPU, read from the AST, and the K3_KDA_GATHER_LOG gate:
classify spots a diagnostic in no known form with it, the probe proves each one is gated."""

from __future__ import annotations

import ast

from k3patch.astkit import attribute_owner, callee_name, walk
from k3patch.shapes import match

ENV = "K3_KDA_GATHER_LOG"

SYNC_METHODS = frozenset(
    "item tolist cpu numpy nonzero masked_select unique argwhere unique_consecutive".split()
)
SYNC_TORCH_FUNCTIONS = SYNC_METHODS | {"equal", "allclose", "is_nonzero"}
SCALAR_CASTS = frozenset({"bool", "int", "float"})
TRUTH_REDUCTIONS = frozenset({"any", "all"})  # a tensor's .any() as a truth value is a bool()
HOST_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "is_xpu", "layout"})
HOST_METHODS = frozenset(
    "numel nelement size stride dim element_size is_contiguous data_ptr".split()
)
_HOST_IF_ALL = {ast.Subscript: ("value",), ast.BinOp: ("left", "right"), ast.UnaryOp: ("operand",)}
GATE_PATTERNS = tuple(
    f'HOLE_os.{read}("{ENV}"{default}) == "1"'
    for read in ("environ.get", "getenv")
    for default in ("", ", HOLE_default", ", default=HOLE_default")
)


def _is_host_value(node: ast.expr) -> bool:
    """Whether `node` is certainly a host value (tensor metadata or a literal), never a tensor."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Attribute):
        return node.attr in HOST_ATTRIBUTES
    if isinstance(node, ast.Call):
        return callee_name(node) in ({"len"} if isinstance(node.func, ast.Name) else HOST_METHODS)
    parts = _HOST_IF_ALL.get(type(node), ())  # a subscript or an operation: host if its parts are
    return bool(parts) and all(_is_host_value(getattr(node, part)) for part in parts)


def _is_mask(node: ast.expr) -> bool:
    """An index expression that is a boolean tensor: indexing with it sizes its output on host."""
    if isinstance(node, ast.Tuple):
        return any(_is_mask(e) for e in node.elts)
    if isinstance(node, ast.Compare):
        return not all(_is_host_value(e) for e in (node.left, *node.comparators))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr | ast.BitAnd | ast.BitXor):
        return True
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert)


def sync_points(root: ast.AST) -> list[tuple[ast.AST, str]]:
    """Every expression under `root` that can make the host wait for the GPU, with its kind."""
    found: list[tuple[ast.AST, str]] = []
    truthy: list[tuple[ast.AST, str]] = []  # reported after the calls, in walk order too
    for node in walk(root):
        for test in truth_tests(node):
            called = test.func if isinstance(test, ast.Call) else None
            if isinstance(called, ast.Attribute) and called.attr in TRUTH_REDUCTIONS:
                truthy.append((test, f"truth value of .{called.attr}()"))
        if isinstance(node, ast.Call):
            name = callee_name(node)
            if isinstance(node.func, ast.Name) and name in SCALAR_CASTS:
                if node.args and not _is_host_value(node.args[0]):
                    found.append((node, f"{name}() of a tensor"))
            elif attribute_owner(node.func, name) == "torch":
                if name in SYNC_TORCH_FUNCTIONS:
                    found.append((node, f"torch.{name}()"))
            elif isinstance(node.func, ast.Attribute) and name in SYNC_METHODS:
                found.append((node, f".{name}()"))
        elif isinstance(node, ast.Subscript) and _is_mask(node.slice):
            found.append((node, "boolean-mask indexing"))
    return found + truthy


def is_gate(test: ast.expr) -> bool:
    """A GATE_PATTERNS test on a bare name (`os`) with a constant default other than "1": it
    reads only the environment (no device work before it decides) and is off when unset."""
    for pattern in GATE_PATTERNS:
        found = match(pattern, test)
        if found is not None:
            default = found.get("HOLE_default", ast.Constant(None))
            owner_ok = isinstance(found["HOLE_os"], ast.Name)
            return owner_ok and isinstance(default, ast.Constant) and default.value != "1"
    return False


def ungated_sync_points(func: ast.AST) -> tuple[list[str], list[str]]:
    """(gated, ungated) sync points of `func`, each 'kind at line N': gated in a gate's body."""
    gates = [n for n in ast.walk(func) if isinstance(n, ast.If) and is_gate(n.test)]
    inside = {id(n) for gate in gates for stmt in gate.body for n in ast.walk(stmt)}
    found: tuple[list[str], list[str]] = ([], [])  # gated, ungated
    for node, kind in sync_points(func):
        found[id(node) not in inside].append(f"{kind} at line {getattr(node, 'lineno', '?')}")
    return found


def truth_tests(node: ast.AST) -> list[ast.expr]:
    """The expressions `node` itself uses as truth values: the test of an `if`, `while`, `x if
    c else y` or `assert`, the operands of `and`/`or`/`not`, a comprehension's `if`s."""
    if isinstance(node, ast.If | ast.While | ast.IfExp | ast.Assert):
        return [node.test]
    if isinstance(node, ast.BoolOp):
        return node.values
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return [node.operand]
    return node.ifs if isinstance(node, ast.comprehension) else []
