"""`python -m plurai.cli ...`: the `plurai` command."""

from plurai.cli.main import main

raise SystemExit(main())
