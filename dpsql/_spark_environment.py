"""Whether a Spark application can run dpsql's release, decided before anything is charged.

A release that is charged and then fails on the executors (no dpsql there, another version of
it, no pandas) has paid for nothing. :func:`check_executors` asks first: pyspark's own Arrow
requirements on the driver, then one tiny job whose tasks report what the executors' Python
can import. Its task function is shipped by value, so that it runs (and reports) where dpsql
cannot be imported.
"""

from __future__ import annotations

import types

from dpsql.errors import EnvironmentUnusable

#: What the executors must import for the release's tasks (``mapInArrow`` needs pandas and pyarrow).
NEEDED = ("dpsql", "pandas", "pyarrow")


def _report(names):
    """An executor's report: its Python, the version (or import error) of each package ``names``
    holds (one tuple) and pyspark's verdict on its Arrow requirements. Imports inside: it is
    shipped by value."""
    import importlib
    import sys

    found = {"python": sys.executable}
    for name in next(iter(names)):
        try:
            found[name] = importlib.import_module(name).__version__
        except Exception as error:  # reported to the driver, which refuses the release
            found[name] = None
            found[f"{name} error"] = f"{type(error).__name__}: {error}"
    try:
        from pyspark.sql.pandas.utils import require_minimum_pandas_version, require_minimum_pyarrow_version

        require_minimum_pandas_version()
        require_minimum_pyarrow_version()
    except Exception as error:  # likewise
        found["arrow error"] = str(error)
    return [found]


#: :func:`_report` without its module: cloudpickle ships a function of no importable module by
#: value, where a module's own function would need dpsql importable to be unpickled.
_SHIPPED_REPORT = types.FunctionType(_report.__code__, {"__builtins__": __builtins__}, "dpsql_report")


def check_executors(session) -> None:
    """Refuse (:class:`dpsql.EnvironmentUnusable`, naming what is missing and where) a Spark
    application whose driver or executors cannot run a release; runs one task per default
    parallelism slot (up to 64). Charges nothing, reads no data."""
    import dpsql

    try:
        from pyspark.sql.pandas.utils import require_minimum_pandas_version, require_minimum_pyarrow_version

        require_minimum_pandas_version()
        require_minimum_pyarrow_version()
    except Exception as error:
        raise EnvironmentUnusable(f"the Spark driver cannot run Arrow tasks: {error}; install 'dpsql[spark]' "
                                  "(pandas and pyarrow as pyspark needs them). Nothing was charged.") from None
    context = session.sparkContext
    slots = max(1, min(64, context.defaultParallelism))
    try:
        reports = context.parallelize([NEEDED] * slots, slots).mapPartitions(_SHIPPED_REPORT).collect()
    except Exception as error:
        raise EnvironmentUnusable(f"Spark's executors could not run a test task ({_gist(error)}); check "
                                  "the executors' Python (PYSPARK_PYTHON, spark.pyspark.python). Nothing was "
                                  "charged.") from None
    for found in reports:
        python = found["python"]
        if found["dpsql"] is None:
            raise EnvironmentUnusable(f"Spark's executors cannot import dpsql ({found['dpsql error']}) with the "
                                      f"Python {python}: install dpsql {dpsql.__version__} (pip install "
                                      "'dpsql[spark]') in the executors' Python, or point PYSPARK_PYTHON "
                                      "(spark.pyspark.python) at a Python that has it. Nothing was charged.")
        if found["dpsql"] != dpsql.__version__:
            raise EnvironmentUnusable(f"Spark's executors run dpsql {found['dpsql']} ({python}), the driver "
                                      f"dpsql {dpsql.__version__}: install the same version on both. Nothing was "
                                      "charged.")
        missing = [f"{name} ({found[f'{name} error']})" for name in NEEDED if found[name] is None]
        if missing or "arrow error" in found:
            problem = f"cannot import {', '.join(missing)}" if missing else found["arrow error"]
            raise EnvironmentUnusable(f"Spark's executors cannot run Arrow tasks with the Python {python}: "
                                      f"{problem}; install 'dpsql[spark]' there. Nothing was charged.")


def _gist(error: Exception) -> str:
    """The Python error at the root of a failed Spark job (the last line naming one), else its first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception"))]
    return (named or lines or [type(error).__name__])[-1 if named else 0][:500]
