"""The package's version (a leaf: metrics and the command line read it without the facade)."""

__version__ = "0.1.0"
