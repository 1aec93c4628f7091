"""``python -m kdash.kernels``: the demo workload (see :mod:`kdash.kernels.workload`)."""

from .workload import main

raise SystemExit(main())
