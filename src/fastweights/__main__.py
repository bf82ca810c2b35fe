"""``python -m fastweights`` is the ``fastweights`` command."""

from .cli import main

raise SystemExit(main())
