"""The layout: no import cycles, layers importing only downwards, modules of readable size, shared checks
living once."""

import ast
import pathlib

import duckdb
import polars as pl
import pytest

import dpsql
import dpsql.polars

PACKAGE = pathlib.Path(dpsql.__file__).parent
FRONT_ENDS = [PACKAGE / "duckdb", PACKAGE / "polars"]
MAX_LINES = 600


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The dpsql modules ``name`` imports, anywhere but under ``if TYPE_CHECKING:``; ``from X
    import y`` imports ``X.y`` when that is a module, else ``X``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - (child.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in child.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
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

    for v in graph:
        if v not in index:
            strong(v)
    return cycles


def test_the_cycle_check_finds_cycles_and_function_level_imports(tmp_path):
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    module = tmp_path / "m.py"
    module.write_text("from dpsql import budget\n\ndef f():\n    import dpsql.polars.counts\n    from . import noise\n"
                      "\nif TYPE_CHECKING:\n    from dpsql import duckdb\n")
    found = _imports("dpsql.m", module, {**_modules(), "dpsql.m": module})
    assert found == {"dpsql.budget", "dpsql.polars.counts", "dpsql.noise"}


def test_no_import_cycles():
    assert _cycles(_graph()) == []


#: The layers, bottom to top (README, "Layout"): a module imports from its own layer and those below.
LAYERS = [("dpsql.noise",), ("dpsql.ledger",), ("dpsql.mechanisms",), ("dpsql.streams",),
          ("dpsql._frontend", "dpsql.api", "dpsql.duckdb", "dpsql.polars", "dpsql.spark")]


def _layer(module: str) -> int | None:
    for k, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return k
    return None


def test_the_layers_import_only_downwards():
    # the core between the layers (publishing, release, counts, budget, ...) counts as below the front ends
    core = len(LAYERS) - 2
    upward = sorted((name, other) for name, imported in _graph().items() for other in imported
                    if name != "dpsql" and _layer(other) is not None
                    and (core if _layer(name) is None else _layer(name)) < _layer(other))
    assert upward == []


def test_no_module_is_too_long():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_both_front_ends_use_the_shared_checks():
    for path in [*(PACKAGE / "duckdb").glob("*.py"), *(PACKAGE / "polars").glob("*.py")]:
        text = path.read_text()
        assert "must be a dpsql.Budget" not in text, path
        assert "NULL value" not in text and "null value(s); every row" not in text, path
    uses = {p.name for d in FRONT_ENDS for p in d.glob("*.py") if "dpsql._frontend" in p.read_text()}
    assert {"ordered.py", "macros.py", "range_sum.py", "_machinery.py", "ldp.py", "counts.py"} <= uses


def test_null_and_nan_keys_are_refused_in_the_same_words_by_both_front_ends():
    budget = dpsql.Budget.in_memory(epsilon=1.0)
    con = duckdb.connect()
    dpsql.duckdb.register(con, budget=budget)
    cases = {"order NULL": ([1, None, 3], ["a", "a", "a"]),
             "order NaN": ([1.0, float("nan"), 3.0], ["a", "a", "a"])}
    for ts, meter in cases.values():
        frame = pl.DataFrame({"ts": ts, "meter": meter, "v": [1.0, 2.0, 3.0]})
        with pytest.raises(dpsql.InvalidTimeKey) as from_polars:
            frame.select(pl.col("v").dpsql.range_sum(order_by="ts", partition_by="meter", method="laplace",
                                                     epsilon=1.0, upper=1.0, budget=budget))
        with pytest.raises(dpsql.InvalidTimeKey) as from_sql, dpsql.duckdb.typed_errors():
            con.sql("SELECT * FROM dp_range_sum('frame', 'ts', 'v', partition_by := 'meter', method := 'laplace', "
                    "epsilon := 1, upper := 1)").fetchall()
        assert str(from_polars.value) == str(from_sql.value)
    assert budget.spent == (0.0, 0.0)
    con.close()


def test_budgets_are_checked_in_the_same_words():
    messages = []
    for call in (lambda: dpsql.duckdb.register(duckdb.connect(), budget="ledger.sqlite"),
                 lambda: pl.col("v").dpsql.range_sum(order_by="ts", budget="ledger.sqlite", epsilon=1.0, upper=1.0),
                 lambda: dpsql.count_stream(pl.DataFrame({"ts": [1.0]}), "ts", every=1.0, start=0, stop=1,
                                            epsilon=1.0, budget="ledger.sqlite")):
        with pytest.raises(dpsql.InvalidParameter) as caught:
            call()
        messages.append(str(caught.value))
    assert set(messages) == {"budget must be a dpsql.Budget, got str"}
