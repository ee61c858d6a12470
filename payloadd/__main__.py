"""``python -m payloadd``: the command line."""

from payloadd.cli._main import main

raise SystemExit(main())
