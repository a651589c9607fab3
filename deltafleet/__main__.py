"""``python -m deltafleet``: the ``deltafleet`` command."""
from deltafleet.cli import main

raise SystemExit(main())
