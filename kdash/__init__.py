"""kdash: a terminal profiling dashboard for GPU inference processes.

The one-call way into a capture from pandas::

    import kdash
    tables = kdash.read_capture("run.kdash")   # dict: table name -> pandas.DataFrame
"""

import os
from importlib.metadata import PackageNotFoundError, version

# Installed, the wheel puts collectors/, tui/, kernels/ and themes/ inside this package. In a
# source checkout they sit beside this folder, and `python -m ...` run from the checkout's root
# imports this folder first; extending __path__ to the checkout's root lets
# `kdash.collectors` and the rest resolve there too. Guarded by pyproject.toml so an installed
# copy never looks at its site-packages neighbours.
_here = os.path.dirname(os.path.abspath(__file__))
_root = os.path.dirname(_here)
if not os.path.isdir(os.path.join(_here, "collectors")) and os.path.isfile(
    os.path.join(_root, "pyproject.toml")
):
    __path__.append(_root)

try:
    __version__ = version("kdash")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"


def read_capture(path):
    """Load a `.kdash` capture into a dict of pandas DataFrames (one per table)."""
    from kdash.capture import load_capture

    return load_capture(path).tables


__all__ = ["__version__", "read_capture"]
