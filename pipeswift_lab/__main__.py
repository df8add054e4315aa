"""``python -m pipeswift_lab`` runs the ``pipeswift-lab`` command."""

from .faces.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
