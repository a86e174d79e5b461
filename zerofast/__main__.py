"""``python -m zerofast``: the same command as the ``zerofast`` console script."""
from .cli import main

raise SystemExit(main())
