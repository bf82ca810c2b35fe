"""The ``fastweights`` command (also ``python -m fastweights``): one module per subcommand
(``mixers``, ``bench``, ``recall``, ``reproduce``, ``train``, ``eval``, ``generate``),
``common`` for what they share, ``main`` for the parser, errors and signals. Nothing else in the
package imports it."""

from .main import main

__all__ = ["main"]
