"""The ``fastweights`` command (also ``python -m fastweights``): one module per subcommand
(``mixers``, ``bench``, ``recall``, ``reproduce``, ``train``, ``eval``, ``generate``,
``export``; the benchmarks ``bench`` runs are fastweights.bench's), ``main`` for the parser,
errors and signals; what they share with the benchmarks (errors, help format, number and
mixer-spec parsing, output folders) is ``fastweights._commands``. Nothing else in the package
imports it: ``fastweights`` (fastweights/__main__.py) is the only door."""

from .main import main

__all__ = ["main"]
