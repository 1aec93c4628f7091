"""kdash: a terminal profiling dashboard for GPU inference processes.

The one-call way into a capture from pandas::

    import kdash
    tables = kdash.read_capture("run.kdash")   # dict: table name -> pandas.DataFrame

The wheel installs the repository's collectors/, tui/, kernels/ and themes/ folders inside this
package (pyproject.toml's `package-dir`); an editable install maps them the same way through
setuptools' import hook. Nothing here looks beside this folder: run from a checkout without
an install, `kdash.collectors` does not resolve, and that is meant (tests run against the
installed package, not the source tree).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kdash")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"


def read_capture(path):
    """Load a `.kdash` capture into a dict of pandas DataFrames (one per table)."""
    from kdash.capture import load_capture

    return load_capture(path).tables


__all__ = ["__version__", "read_capture"]
