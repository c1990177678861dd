"""``python -m dmuon_tools``: the same as the ``dmuon-tools`` command."""

from dmuon_tools.cli import main

raise SystemExit(main())
