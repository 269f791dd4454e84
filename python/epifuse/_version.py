"""The epifuse version: the one place it is written.

pyproject.toml reads it (``[tool.setuptools.dynamic]``, statically, without
importing the package) and ``epifuse.__version__`` re-exports it.
"""

__version__ = "0.1.0"
