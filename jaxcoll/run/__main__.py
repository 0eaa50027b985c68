"""``python -m jaxcoll.run``: the same as the ``jaxcoll-run`` command."""

from . import main

main()
