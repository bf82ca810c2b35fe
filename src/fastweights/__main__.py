"""``python -m fastweights`` is the ``fastweights`` command."""

import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while Python loads the command: one line, as in main()
    print("fastweights: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
