"""`python -m cli ...`: the `plurai` command."""

from cli.main import main

raise SystemExit(main())
