"""`python -m dynamo_ftctl` runs the `ftctl` command line."""

from dynamo_ftctl.cli.entry import main

raise SystemExit(main())
