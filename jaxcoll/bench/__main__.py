"""``python -m jaxcoll.bench``: the same as the ``jaxcoll-bench`` console script."""

from . import main

raise SystemExit(main())
