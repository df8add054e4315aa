"""``python -m pipeswift_lab`` runs the ``pipeswift-lab`` command."""
from .cli import main

raise SystemExit(main())
