"""The vocabulary every patch and every command shares: verdicts, shapes, site results.

This module is imported by the patch modules, by the fast path and by the verify child, so it
uses the standard library only (no libcst, no typer, no rich).
"""

from __future__ import annotations

import ast
import builtins
import functools
import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from k3patch.codemod import Codemods

from k3patch.shapes import Bindings, VersionRange, match, outside_range
from k3patch.verdicts import SiteResult, Verdict, summarise  # noqa: F401 (the patches use them here)


def combined_verdict(verdicts: Iterable[Verdict]) -> Verdict | None:
    """One verdict for a whole made of parts (a site's pieces, a change's files): any drifted
    part makes it drifted, parts that all agree give theirs; None for a mixture (some applied,
    some pending: half done, perhaps by hand) and for no parts at all."""
    seen = set(verdicts)
    if Verdict.DRIFTED in seen:
        return Verdict.DRIFTED
    return seen.pop() if len(seen) == 1 else None


@dataclass(frozen=True)
class Shape:
    """One known shape of a site: the code as it appears in some tree, declared as source text.

    `source` is compared by `site_fingerprint`, so formatting, comments, quote style and
    docstrings do not matter; names, operators and structure do. A source with holes
    (`HOLE_x`, `...`; see k3patch.shapes) is compared with `match` instead. `versions` are the
    vLLM versions the shape was seen in, as data (`shapes.outside_range` words a report).
    """

    name: str
    verdict: Verdict
    source: str
    origin: str = ""
    versions: VersionRange | None = None

    @property
    def fingerprint(self) -> str:
        return source_fingerprint(self.source)

    def match(self, target: ast.AST | Sequence[ast.stmt]) -> Bindings | None:
        """What each hole of this shape matched in `target`; None when `target` is not in it."""
        return match(self.source, target)


# --------------------------------------------------------------------------------------------
# Fingerprints: the AST with positions, comments and docstrings removed. Two pieces of code
# have the same fingerprint exactly when Python reads them as the same statements.


def _strip_docstrings(node: ast.AST) -> ast.AST:
    for child in ast.walk(node):
        body = getattr(child, "body", None)
        if (
            isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module)
            and isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            child.body = body[1:] or [ast.Pass()]
    return node


def normalised_dump(node: ast.AST | list[ast.stmt]) -> str:
    """A formatting-insensitive text of a node (or a list of statements)."""
    import copy

    if isinstance(node, list):
        node = ast.Module(body=node, type_ignores=[])
    node = _strip_docstrings(copy.deepcopy(node))
    return ast.dump(node, annotate_fields=True, include_attributes=False)


def site_fingerprint(node: ast.AST | list[ast.stmt]) -> str:
    """The fingerprint of a site: 16 hex digits of sha256 over its normalised AST."""
    return hashlib.sha256(normalised_dump(node).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=512)
def source_fingerprint(source: str) -> str:
    """The fingerprint of a code snippet (a whole definition or a run of statements). Cached:
    a declared shape's fingerprint is asked for at every site it is held against."""
    module = ast.parse(dedent(source))
    body: list[ast.stmt] = module.body
    return site_fingerprint(body[0] if len(body) == 1 else body)


def dedent(source: str) -> str:
    """A snippet written indented in a triple-quoted string, as the text of a module."""
    import textwrap

    return textwrap.dedent(source).strip("\n") + "\n"


def clip_lines(text: str, limit: int = 40) -> str:
    """`text` as it is when it has at most `limit` lines, else its first `limit` lines and a
    line saying how many more there are (a report shows a long function's head)."""
    lines = text.splitlines()
    if len(lines) <= limit:
        return text
    return "\n".join([*lines[:limit], f"... ({len(lines) - limit} more lines)"])


def outline(outer: Sequence[ast.stmt], inner: Sequence[str], unit: str = "    ") -> str:
    """A report's view of code nested in the statements `outer` (outermost first): the first
    line of each, one `unit` deeper than the one before, then the `inner` lines one deeper."""
    heads = [unit * depth + ast.unparse(stmt).splitlines()[0] for depth, stmt in enumerate(outer)]
    return "\n".join([*heads, *(unit * len(outer) + line for line in inner)])


# --------------------------------------------------------------------------------------------
# The sources a patch reads: a read-only view over the target files of one tree.


BOM = b"\xef\xbb\xbf"


class SourceError(Exception):
    """A target file exists but cannot be read as Python source (binary junk, syntax error)."""


@dataclass
class SourceFile:
    """One target file as bytes, with its text and AST computed on first use."""

    rel: str
    data: bytes | None
    # The vLLM version of the tree the file belongs to (None: unknown), for version notes.
    version: str | None = None
    _text: str | None = field(default=None, repr=False)
    _tree: ast.Module | None = field(default=None, repr=False)

    @property
    def exists(self) -> bool:
        return self.data is not None

    @property
    def bom(self) -> bool:
        """Whether the file starts with a UTF-8 byte-order mark (Python accepts it; `text`
        leaves it out, and `encode` puts it back)."""
        return self.data is not None and self.data.startswith(BOM)

    def encode(self, text: str) -> bytes:
        """New text for this file as bytes, with its byte-order mark kept if it had one."""
        return (BOM if self.bom else b"") + text.encode("utf-8")

    @property
    def text(self) -> str:
        if self._text is None:
            if self.data is None:
                raise SourceError(f"{self.rel}: file is absent")
            try:
                self._text = self.data[len(BOM) if self.bom else 0 :].decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SourceError(
                    f"{self.rel}: not UTF-8 text (byte {exc.start}); restore it from the wheel"
                ) from None
            if "\x00" in self._text:
                raise SourceError(f"{self.rel}: contains NUL bytes; restore it from the wheel")
        return self._text

    @property
    def tree(self) -> ast.Module:
        if self._tree is None:
            try:
                self._tree = ast.parse(self.text, filename=self.rel)
            except SyntaxError as exc:
                raise SourceError(
                    f"{self.rel}: does not parse ({exc.msg}, line {exc.lineno}); "
                    "restore it from the wheel"
                ) from None
            except (RecursionError, MemoryError):
                # The parser's own limits (3.11: deep operator chains raise RecursionError,
                # thousands of unary operators MemoryError): no vLLM file comes near them.
                raise SourceError(
                    f"{self.rel}: code nested too deeply to parse (a generated or hostile "
                    "file?); restore it from the wheel"
                ) from None
        return self._tree

    def depth(self) -> int:
        """How many nodes deep the file's syntax tree goes, walked without recursion (0 for a
        file that is absent or does not parse): which file is too deep to analyse."""
        try:
            todo: list[tuple[ast.AST, int]] = [(self.tree, 1)]
        except SourceError:
            return 0
        deepest = 0
        while todo:
            node, level = todo.pop()
            deepest = max(deepest, level)
            todo.extend((child, level + 1) for child in ast.iter_child_nodes(node))
        return deepest

    def segment(self, node: ast.AST) -> str:
        """The exact source text of a node, for reports."""
        return ast.get_source_segment(self.text, node) or ast.unparse(node)


class Sources:
    """The target files of a tree, read once and shared by every patch in one run."""

    def __init__(self, reader: Callable[[str], bytes | None], version: str | None = None) -> None:
        self._reader = reader
        self.version = version
        self._files: dict[str, SourceFile] = {}

    def __getitem__(self, rel: str) -> SourceFile:
        if rel not in self._files:
            self._files[rel] = SourceFile(rel, self._reader(rel), version=self.version)
        return self._files[rel]

    def with_changes(self, changes: Mapping[str, str]) -> Sources:
        """A view of the same tree with some files replaced by new text (nothing is written).
        Unchanged files are shared with this view, parsed trees included."""
        return _ChangedSources(self, dict(changes))


class _ChangedSources(Sources):
    def __init__(self, base: Sources, changes: dict[str, str]) -> None:
        super().__init__(lambda rel: base[rel].encode(changes[rel]), base.version)
        self._base = base
        self._changes = changes

    def __getitem__(self, rel: str) -> SourceFile:
        if rel not in self._changes:
            return self._base[rel]
        return super().__getitem__(rel)


# --------------------------------------------------------------------------------------------
# Helpers that patches use to find their sites.


class AmbiguousDefinition(Exception):
    """A name a patch looks up is bound more than once in its scope. The last binding is the live
    one, so patching the first would patch dead code and still read as applied: this is drift."""

    def __init__(self, scope: ast.AST, name: str, lines: list[int]) -> None:
        self.scope = scope
        self.name = name
        self.lines = lines
        where = ", ".join(str(n) for n in lines)
        super().__init__(
            f"{name} is bound {len(lines)} times in one scope (lines {where}); "
            "the last binding is the live one, so k3patch will not guess which to patch"
        )


def _binds(stmt: ast.stmt, name: str) -> bool:
    """Whether a statement of a scope's body binds `name` in that scope."""
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return stmt.name == name
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return any((a.asname or a.name.split(".")[0]) == name for a in stmt.names)
    if isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        # Only a stored name binds: `name.attr = x` and `table[name] = x` read `name`.
        return any(
            isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)
            for t in targets
            for n in ast.walk(t)
        )
    return False


def bindings(body: Iterable[ast.stmt], name: str) -> list[ast.stmt]:
    """The statements of a scope's body that bind `name` in that scope (an import, a def, a
    class, an assignment to the bare name), in source order. The one rule for "what binds"."""
    return [stmt for stmt in body if _binds(stmt, name)]


def walk_scope(nodes: Iterable[ast.AST]) -> Iterator[ast.AST]:
    """`nodes` (a scope's statements) and every node under them that belongs to that scope: a
    nested function or class is yielded but not entered (its code runs when it is called, or
    never)."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            stack.extend(ast.iter_child_nodes(node))


def parent_map(root: ast.AST) -> dict[int, ast.AST]:
    """id(node) -> its parent, for every node under `root` (ast nodes do not know theirs)."""
    return {id(child): node for node in ast.walk(root) for child in ast.iter_child_nodes(node)}


def _bound_once(
    scope: ast.AST, body: list[ast.stmt], name: str, kind: type | tuple[type, ...]
) -> Any:
    """The one statement of `body` that defines `name` as a `kind`; None when there is none.
    Raises AmbiguousDefinition when `name` is bound more than once there."""
    found = bindings(body, name)
    if len(found) > 1:
        raise AmbiguousDefinition(scope, name, [stmt.lineno for stmt in found])
    if found and isinstance(found[0], kind):
        return found[0]
    return None


def find_class(module: ast.Module, name: str) -> ast.ClassDef | None:
    """The module's class `name`; AmbiguousDefinition if the module binds `name` twice."""
    found: ast.ClassDef | None = _bound_once(module, module.body, name, ast.ClassDef)
    return found


def find_method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    """The class's method `name`; AmbiguousDefinition if the class body binds `name` twice."""
    found: ast.FunctionDef | None = _bound_once(cls, cls.body, name, ast.FunctionDef)
    return found


def find_function(module: ast.Module, name: str) -> ast.FunctionDef | None:
    """The module's function `name`; AmbiguousDefinition if the module binds `name` twice."""
    found: ast.FunctionDef | None = _bound_once(module, module.body, name, ast.FunctionDef)
    return found


def find_scope(module: ast.Module, path: str) -> ast.ClassDef | ast.FunctionDef | None:
    """The class or function at `path` ("Class", "Class.method", "function"): each component
    looked up with the same refusal of ambiguity as find_class / find_method."""
    node: ast.AST = module
    for part in path.split("."):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            return None
        node = _bound_once(node, body, part, (ast.ClassDef, ast.FunctionDef))
        if node is None:
            return None
    assert isinstance(node, ast.ClassDef | ast.FunctionDef)
    return node


def find_def(module: ast.Module, path: str) -> ast.FunctionDef | None:
    """The function or method at `path` ("function", "Class.method"), looked up as find_scope
    does; None when it is absent or `path` names a class."""
    found = find_scope(module, path)
    return found if isinstance(found, ast.FunctionDef) else None


def mentioned_names(node: ast.AST, *, everything: bool = False) -> set[str]:
    """The names, attribute names and keyword-argument names a node mentions. With
    `everything`, also parameter names, def/class names and string constants (the identifiers
    a marker or a fork field can hide in)."""
    found: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            found.add(child.id)
        elif isinstance(child, ast.Attribute):
            found.add(child.attr)
        elif isinstance(child, ast.keyword) and child.arg:
            found.add(child.arg)
        elif not everything:
            continue
        elif isinstance(child, ast.arg):
            found.add(child.arg)
        elif isinstance(child, ast.Constant) and isinstance(child.value, str):
            found.add(child.value)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(child.name)
    return found


def module_binds(module: ast.Module, name: str) -> bool:
    """Whether the module binds `name` at top level (an import, a def, a class or an assignment)."""
    return bool(bindings(module.body, name))


def loaded_names(nodes: Iterable[ast.AST], skip: Iterable[ast.AST] = ()) -> set[str]:
    """The bare names read under `nodes`, not counting the subtrees in `skip` (by identity)."""
    skipped = {id(node) for node in skip}
    found: set[str] = set()
    stack = [node for node in nodes if id(node) not in skipped]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            found.add(node.id)
        stack.extend(c for c in ast.iter_child_nodes(node) if id(c) not in skipped)
    return found


def stored_names(nodes: Iterable[ast.AST]) -> set[str]:
    """The bare names assigned under `nodes` (targets, loop variables, `as` names of `with`)."""
    return {
        n.id
        for node in nodes
        for n in ast.walk(node)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }


def attribute_names(nodes: Iterable[ast.AST], owner: str, ctx: type[ast.expr_context]) -> set[str]:
    """The attributes of the bare name `owner` (`self`) that `nodes` read (ctx ast.Load) or
    assign (ast.Store)."""
    return {
        n.attr
        for node in nodes
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == owner
        and isinstance(n.ctx, ctx)
    }


def attribute_assignments(nodes: Iterable[ast.AST], owner: str) -> list[tuple[str, ast.expr]]:
    """(attribute, value) of every one-target `owner.attribute = value` and
    `owner.attribute: T = value` under `nodes` (nested scopes included), in `ast.walk` order."""
    found = []
    for n in (n for node in nodes for n in ast.walk(node)):
        if isinstance(n, ast.Assign) and len(n.targets) == 1:
            target, value = n.targets[0], n.value
        elif isinstance(n, ast.AnnAssign) and n.value is not None:
            target, value = n.target, n.value
        else:
            continue
        if isinstance(target, ast.Attribute) and attribute_owner(target, target.attr) == owner:
            found.append((target.attr, value))
    return found


def imported_names(node: ast.AST) -> set[str]:
    """The names the import statements anywhere under `node` bind: an alias's `as` name, else
    the first component of the imported name (`import a.b` binds `a`)."""
    return {
        (alias.asname or alias.name).split(".")[0]
        for n in ast.walk(node)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for alias in n.names
    }


def parameter_names(
    func: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, *, positional: bool = False
) -> set[str]:
    """The named parameters of `func` (positional-only, ordinary and keyword-only; not `*args`
    or `**kwargs`). With `positional`, only those a caller can pass by position."""
    args = func.args
    return {
        a.arg for a in [*args.posonlyargs, *args.args, *([] if positional else args.kwonlyargs)]
    }


def assigned_name(stmt: ast.AST) -> str | None:
    """The name a plain `name = value` statement binds (one target, a bare name); else None."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target = stmt.targets[0]
        return target.id if isinstance(target, ast.Name) else None
    return None


def named_values(stmts: Iterable[ast.AST]) -> dict[str, ast.expr]:
    """name -> value of the plain `name = value` statements among `stmts` (the last one wins)."""
    return {
        name: s.value for s in stmts if (name := assigned_name(s)) and isinstance(s, ast.Assign)
    }


def resolve_name(expr: ast.expr, values: Mapping[str, ast.expr], limit: int = 4) -> ast.expr:
    """`expr`, or, when it is a bare name in `values`, the value it names, followed through
    further names at most `limit` times in all (a cycle stops there)."""
    while limit > 0 and isinstance(expr, ast.Name) and expr.id in values:
        expr, limit = values[expr.id], limit - 1
    return expr


def temporaries_before(block: Sequence[ast.stmt], index: int, expr: ast.AST) -> list[ast.Assign]:
    """The run of plain `name = value` statements right before `block[index]` that `expr` reads,
    directly or through one another, in source order: it ends at the first statement that is
    not such a temporary."""
    wanted = loaded_names([expr])
    temps: list[ast.Assign] = []
    for stmt in reversed(block[:index]):
        if not isinstance(stmt, ast.Assign) or assigned_name(stmt) not in wanted:
            break
        temps.insert(0, stmt)
        wanted |= loaded_names([stmt.value])
    return temps


def strip_nots(expr: ast.expr) -> tuple[ast.expr, int]:
    """`expr` without its leading `not`s, and how many there were."""
    count = 0
    while isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        expr, count = expr.operand, count + 1
    return expr, count


def attribute_owner(expr: ast.AST, attr: str) -> str | None:
    """The bare name `x` of an `x.<attr>` expression, else None."""
    if isinstance(expr, ast.Attribute) and expr.attr == attr and isinstance(expr.value, ast.Name):
        return expr.value.id
    return None


def ancestors(
    node: ast.AST, parents: Mapping[int, ast.AST], stop: ast.AST | None = None
) -> list[ast.AST]:
    """The nodes that enclose `node`, innermost first, from a parent_map: up to its root, or up
    to (not including) `stop`."""
    found = []
    parent = parents.get(id(node))
    while parent is not None and parent is not stop:
        found.append(parent)
        parent = parents.get(id(parent))
    return found


def loops_over(node: ast.AST, name: str) -> list[ast.For]:
    """The `for` loops under `node` (itself included) whose iterable mentions `name` (as a
    name, an attribute or a keyword, as mentioned_names reads it)."""
    return [n for n in ast.walk(node) if isinstance(n, ast.For) and name in mentioned_names(n.iter)]


def expression_dump(source: str) -> str:
    """normalised_dump of the expression written in `source`."""
    return normalised_dump(ast.parse(source, mode="eval").body)


def unbound_names(nodes: Iterable[ast.AST], module: ast.Module, func: ast.FunctionDef) -> set[str]:
    """The bare names `nodes` (code of `func`, a function of `module`) read that nothing binds:
    not the module as it runs, not the builtins, not `func`'s parameters, nor an assignment or
    import anywhere in `func` (coarse: bound somewhere in it counts as bound). Reading one
    raises NameError."""
    bound = runtime_module_names(module) | set(dir(builtins)) | parameter_names(func)
    return loaded_names(nodes) - bound - imported_names(func) - stored_names([func])


def unset_attributes(nodes: Iterable[ast.AST], cls: ast.ClassDef) -> set[str]:
    """The attributes of `self` that `nodes` read but that nothing in `cls` assigns to `self`
    and that are not methods of `cls`. Reading one raises AttributeError."""
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    return (
        attribute_names(nodes, "self", ast.Load)
        - attribute_names([cls], "self", ast.Store)
        - methods
    )


def is_call_to(expr: ast.AST, name: str, owner: str = "self") -> bool:
    """Whether `expr` calls `name(...)` or `<owner>.name(...)` (a method on `self` by default)."""
    if not isinstance(expr, ast.Call):
        return False
    func = expr.func
    return (isinstance(func, ast.Name) and func.id == name) or attribute_owner(func, name) == owner


def callee_name(call: ast.Call) -> str:
    """The name a call calls: `f` for `f(...)`, `m` for `a.b.m(...)`; "" for anything else
    (`f()()`, `table[k](...)`)."""
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def named_items(holder: ast.AST) -> dict[str, tuple[ast.AST, ast.expr | None]]:
    """The named items of a holder, name -> (the node that names the item, its value): a
    class's annotated fields (the AnnAssign, its value), a function's positional parameters
    (the ast.arg, its default), a call's keyword arguments (not `**x`) and a dict literal's
    string keys (the key, its value). None where there is no value; a name written twice is
    its last item; any other node has none."""
    if isinstance(holder, ast.ClassDef):
        body = holder.body
        return {
            s.target.id: (s, s.value)
            for s in body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        }
    if isinstance(holder, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        params = [*holder.args.posonlyargs, *holder.args.args]
        defaults: list[ast.expr | None] = [None] * (len(params) - len(holder.args.defaults))
        pairs = zip(params, [*defaults, *holder.args.defaults], strict=True)
        return {p.arg: (p, d) for p, d in pairs}
    if isinstance(holder, ast.Call):
        return {k.arg: (k, k.value) for k in holder.keywords if k.arg}
    if isinstance(holder, ast.Dict):
        return {
            k.value: (k, v)
            for k, v in zip(holder.keys, holder.values, strict=True)
            if isinstance(k, ast.Constant) and isinstance(k.value, str)
        }
    return {}


def runtime_module_names(module: ast.Module) -> set[str]:
    """The names a module binds when it runs: top-level imports, defs, classes and assignments,
    also inside top-level `if` and `try` blocks, but not under `if TYPE_CHECKING:` (those
    imports exist only for the type checker)."""
    names: set[str] = set()

    def visit(block: list[ast.stmt]) -> None:
        for node in block:
            if isinstance(node, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                names.update(stored_names([node]))
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in mentioned_names(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for sub in (node.body, *(h.body for h in node.handlers), node.orelse):
                    visit(sub)
                visit(node.finalbody)

    visit(module.body)
    return names


def string_constants(nodes: Iterable[ast.AST]) -> list[str]:
    """The values of the string constants among `nodes` (not under them), in order."""
    return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def imported_module(body: Iterable[ast.stmt], name: str) -> str | None:
    """The module `name` stands for where every statement of `body` (a scope's) that binds it
    is an `import` of one module: `import os` and `import os.path` bind `os` to "os", `import
    posix as os` to "posix". "" when anything else binds it too (a def, an assignment, `from m
    import name`, a second module); None when nothing binds it."""
    found = bindings(body, name)
    if not found:
        return None
    modules = {
        alias.name if alias.asname else alias.name.split(".")[0]
        for stmt in found
        if isinstance(stmt, ast.Import)
        for alias in stmt.names
        if (alias.asname or alias.name.split(".")[0]) == name
    }
    plain = len(modules) == 1 and all(isinstance(stmt, ast.Import) for stmt in found)
    return modules.pop() if plain else ""


def walk_code(root: ast.AST) -> Iterator[ast.AST]:
    """`root` and every node under it except annotations (where `A | B` and `x[...]` are types)
    and a def's parameter list (its defaults are walked); nested defs are entered."""
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


def truth_tests(node: ast.AST) -> list[ast.expr]:
    """The expressions that `node` itself uses as truth values: the test of an `if`, `while`,
    conditional expression or `assert`, the operands of `and`/`or` and `not`, a comprehension's
    `if`s."""
    if isinstance(node, ast.If | ast.While | ast.IfExp | ast.Assert):
        return [node.test]
    if isinstance(node, ast.BoolOp):
        return node.values
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return [node.operand]
    return node.ifs if isinstance(node, ast.comprehension) else []


def shape_detail(shape: Shape, source: SourceFile) -> str:
    """A matched shape's detail for a report: its origin, and a note when the tree's vLLM is
    outside the versions the shape was seen in (the shape is still known; the tree is unusual)."""
    note = outside_range(shape.versions, source.version)
    return "; ".join(part for part in (shape.origin, note) if part)


def match_shapes(
    patch_id: str,
    site: str,
    source: SourceFile,
    node: ast.AST,
    shapes: Iterable[Shape],
) -> SiteResult:
    """Classify a located node against a table of known shapes; anything else is drift."""
    shapes = tuple(shapes)
    found = site_fingerprint(node)
    for shape in shapes:
        if shape.fingerprint == found:
            return SiteResult(
                patch_id=patch_id,
                site=site,
                file=source.rel,
                verdict=shape.verdict,
                shape=shape.name,
                detail=shape_detail(shape, source),
                line=getattr(node, "lineno", None),
            )
    return SiteResult(
        patch_id=patch_id,
        site=site,
        file=source.rel,
        verdict=Verdict.DRIFTED,
        detail="the site is in no shape k3patch knows; nothing will be written",
        line=getattr(node, "lineno", None),
        found=source.segment(node),
        expected=tuple(f"{s.name} ({s.verdict.value})" for s in shapes),
    )


def drifted(
    patch_id: str,
    site: str,
    source: SourceFile,
    nodes: Sequence[ast.AST],
    why: str,
    expected: Iterable[str] = (),
) -> SiteResult:
    """A drifted site: `why` and that nothing will be written, the source of `nodes` (one or
    more statements of `source`) as found, at the first one's line, and what was expected."""
    return SiteResult(
        patch_id=patch_id,
        site=site,
        file=source.rel,
        verdict=Verdict.DRIFTED,
        detail=f"{why}; nothing will be written",
        line=getattr(nodes[0], "lineno", None),
        found="\n".join(source.segment(node) for node in nodes),
        expected=tuple(expected),
    )


# --------------------------------------------------------------------------------------------
# What a patch module provides.


@dataclass(frozen=True)
class ProbeOutcome:
    """What a behaviour probe found on the real (patched) code."""

    ok: bool
    summary: str
    checks: tuple[str, ...] = ()


class Patch:
    """Base class of every module in `patches/`: a module defines one subclass and `PATCH`.

    A patch reads its sites from `Sources` with `ast` (classification never needs libcst), and
    rewrites pending sites through the libcst codemods of `rewrite`. The engine knows no patch
    by name.
    """

    id: str = ""
    title: str = ""
    # Paths of every file the patch reads, relative to the `vllm` package dir.
    files: tuple[str, ...] = ()
    # Dotted module names that `verify` imports once the patch is in place.
    modules: tuple[str, ...] = ()
    # One line for `status --help`-like listings: what the patch does not cover.
    caveat: str = ""
    # Ids of patches whose rewrite must run before this one's (and whose probe's names this
    # one may rely on). The registry orders patches by these, then by id; a cycle or an unknown
    # id is a bug in the patch set and fails at load.
    after: tuple[str, ...] = ()

    def classify(self, sources: Sources) -> list[SiteResult]:
        raise NotImplementedError

    def rewrite(self, sources: Sources, pending: list[SiteResult], files: Codemods) -> None:
        """Rewrite the `pending` sites as libcst codemods on `files[rel]` (k3patch/codemod.py):
        the engine parses each file once, prints it once, then compiles and re-classifies."""
        raise NotImplementedError

    def probe(self) -> ProbeOutcome | None:
        """Exercise the patched behaviour in the verify child (vLLM importable, no GPU)."""
        return None

    def result(
        self, site: str, file: str, verdict: Verdict, detail: str = "", shape: str = ""
    ) -> SiteResult:
        return SiteResult(
            patch_id=self.id, site=site, file=file, verdict=verdict, detail=detail, shape=shape
        )
