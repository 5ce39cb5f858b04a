"""The ``streamrl`` command line.

The top layer (``docs/architecture.md``): may import anything.
"""
