"""Every environment variable the product and the example project read, found in their source by
an AST walk (nothing is imported or run): the strict readers' calls (``env_str("X")`` and the
other ``config.env`` helpers, ``cleanup.conf``'s ``setting("X", ...)``) and the raw ones
(``os.environ.get("X")``, ``os.environ["X"]``, ``os.environ.setdefault("X", ...)``,
``os.getenv("X")``, ``"X" in os.environ``). A name given as a constant (``MASTER_VARIABLE``) or
as a loop over a module's constant collection (``for name in FILES``) is resolved; a read that
cannot be resolved is reported with ``name=None``.

``.venv/bin/python -m tests.support.env_names`` prints the names, one a line, then their count;
``--raw`` lists the raw reads with where they are. tests/unit/cleanup/test_conf.py checks the list
against docs/CONFIGURATION.md.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("cleanup", "reservations", "config", "gunicorn.conf.py", "manage.py")
# The strict readers: config.env's helpers and cleanup.conf's field declaration.
READERS = frozenset(
    {
        "setting",
        "env_str",
        "env_bool",
        "env_int",
        "env_float",
        "env_list",
        "env_choice",
        "env_typed",
    }
)
RAW_METHODS = frozenset({"get", "setdefault"})
# Reads past the strict readers. os.environ.setdefault is not one: it gives a variable a default
# (DJANGO_SETTINGS_MODULE, the local and test settings' values) that a strict reader then reads.
RAW = frozenset({"os.environ.get", "os.environ[]", "os.getenv", "in os.environ"})


@dataclass(frozen=True)
class Read:
    name: str | None  # None: a name the walk cannot resolve (a reader's own parameter)
    path: str
    line: int
    how: str  # "env_int", "os.environ.get", ...

    @property
    def raw(self) -> bool:
        return self.how in RAW


def source_files(root: Path = ROOT) -> list[Path]:
    files: list[Path] = []
    for entry in SOURCES:
        path = root / entry
        if path.is_file():
            files.append(path)
        else:
            files += sorted(p for p in path.rglob("*.py") if "migrations" not in p.parts)
    return files


def _strings(node: ast.AST) -> list[str] | None:
    """The strings a constant expression holds: a literal, or a tuple, list, set or
    ``frozenset({...})`` of literals; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 1:
        if node.func.id in {"frozenset", "set", "tuple"}:
            return _strings(node.args[0])
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        found = [_strings(element) for element in node.elts]
        if all(item is not None and len(item) == 1 for item in found):
            return [item[0] for item in found if item]
    return None


@dataclass
class _Constants:
    strings: dict[str, list[str]]  # a constant's name -> its strings
    dicts: dict[str, tuple[list[str], list[str]]]  # a constant dict's name -> (keys, values)


def _module_constants(tree: ast.Module) -> _Constants:
    constants = _Constants({}, {})
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target, value = statement.target, statement.value
        else:
            continue
        if not isinstance(target, ast.Name):
            continue
        if isinstance(value, ast.Dict):
            keys = [_strings(k) if k is not None else None for k in value.keys]
            values = [_strings(v) for v in value.values]
            constants.dicts[target.id] = (
                [s for k in keys if k for s in k],
                [s for v in values if v for s in v],
            )
        elif (strings := _strings(value)) is not None:
            constants.strings[target.id] = strings
    return constants


def _loop_binding(
    target: ast.expr, source: ast.expr, constants: _Constants
) -> dict[str, list[str]]:
    """The loop variables ``target`` binds to a module constant's strings: ``for name in
    FILES``, ``for query, name in SETTING_FOR_QUERY.items()`` (and comprehensions); none for a
    loop over anything else."""
    method = ""
    if isinstance(source, ast.Call) and isinstance(source.func, ast.Attribute):
        method, source = source.func.attr, source.func.value
    if not isinstance(source, ast.Name):
        return {}
    if source.id in constants.strings and not method and isinstance(target, ast.Name):
        return {target.id: constants.strings[source.id]}
    if source.id not in constants.dicts:
        return {}
    keys, values = constants.dicts[source.id]
    if method == "items" and isinstance(target, ast.Tuple) and len(target.elts) == 2:
        return {
            element.id: strings
            for element, strings in zip(target.elts, (keys, values), strict=True)
            if isinstance(element, ast.Name)
        }
    if isinstance(target, ast.Name) and method in {"", "keys", "values"}:
        return {target.id: values if method == "values" else keys}
    return {}


def _is_os_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id if func.id in READERS else None
    if isinstance(func, ast.Attribute):
        if func.attr in RAW_METHODS and _is_os_environ(func.value):
            return f"os.environ.{func.attr}"
        if func.attr == "getenv" and isinstance(func.value, ast.Name) and func.value.id == "os":
            return "os.getenv"
        if func.attr in READERS and func.attr != "setting":  # env.env_int(...)
            return func.attr
    return None


def _reads_in(path: Path, root: Path, every_constant: dict[str, list[str]]) -> Iterator[Read]:
    tree = ast.parse(path.read_text(), filename=str(path))
    constants = _module_constants(tree)
    relative = str(path.relative_to(root))

    def names(node: ast.expr, loops: dict[str, list[str]]) -> list[str | None]:
        if (strings := _strings(node)) is not None:
            return list(strings)
        if isinstance(node, ast.Name):  # a loop variable, else a module constant
            found = loops.get(node.id) or constants.strings.get(node.id)
            return list(found) if found else [None]
        if isinstance(node, ast.Attribute):  # redis_sentinel.MASTER_VARIABLE
            found = every_constant.get(node.attr)
            return list(found) if found else [None]
        return [None]

    def read(node: ast.AST, loops: dict[str, list[str]]) -> Iterator[Read]:
        if isinstance(node, ast.Call) and node.args and (how := _called_name(node)):
            for name in names(node.args[0], loops):
                yield Read(name, relative, node.lineno, how)
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and _is_os_environ(node.value)
        ):
            for name in names(node.slice, loops):
                yield Read(name, relative, node.lineno, "os.environ[]")
        elif (
            isinstance(node, ast.Compare)
            and len(node.ops) == 1
            and isinstance(node.ops[0], ast.In | ast.NotIn)
            and _is_os_environ(node.comparators[0])
        ):
            for name in names(node.left, loops):
                yield Read(name, relative, node.lineno, "in os.environ")

    def visit(node: ast.AST, loops: dict[str, list[str]]) -> Iterator[Read]:
        """Each read under ``node``, a loop's variables known only inside that loop."""
        yield from read(node, loops)
        inner = loops
        if isinstance(node, ast.For):
            inner = {**loops, **_loop_binding(node.target, node.iter, constants)}
            for child in (node.target, node.iter, *node.orelse):
                yield from visit(child, loops)
            for child in node.body:
                yield from visit(child, inner)
            return
        if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            for generator in node.generators:
                inner = {**inner, **_loop_binding(generator.target, generator.iter, constants)}
        for child in ast.iter_child_nodes(node):
            yield from visit(child, inner)

    yield from visit(tree, {})


def reads(root: Path = ROOT) -> list[Read]:
    """Every read of an environment variable in the product and the example project."""
    files = source_files(root)
    every_constant: dict[str, list[str]] = {}
    for path in files:
        every_constant.update(_module_constants(ast.parse(path.read_text())).strings)
    return [read for path in files for read in _reads_in(path, root, every_constant)]


def names(root: Path = ROOT) -> set[str]:
    """The names of every variable read."""
    return {read.name for read in reads(root) if read.name}


def main(argv: list[str]) -> int:
    if "--raw" in argv:
        for read in reads():
            if read.raw:
                print(f"{read.path}:{read.line}: {read.how}({read.name})")
        return 0
    found = sorted(names())
    print("\n".join(found))
    print(f"{len(found)} names")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
