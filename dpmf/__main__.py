"""``python -m dpmf`` runs the ``dpmf`` command."""

from dpmf.cli import main

raise SystemExit(main())
