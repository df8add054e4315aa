"""The toolkit's version, written into every spec and checkpoint header (a leaf: anything may import it)."""

__version__ = "0.1.0"
