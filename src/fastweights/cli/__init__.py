"""The ``fastweights`` command (also ``python -m fastweights``): one module per subcommand
(``mixers``, ``bench``, ``recall``, ``reproduce``, ``train``, ``eval``, ``generate``,
``export``; ``bench`` is a package with one module per benchmark), ``common`` for what they
share (errors, help format, number and mixer-spec parsing, output folders), ``main`` for the
parser, errors and signals. Nothing else in the package imports it (a module's
``if __name__ == "__main__"`` block, an entry point, may run it)."""

from .main import main

__all__ = ["main"]
