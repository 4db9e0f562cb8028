"""Kimi K3 + DSpark speculative decoding on Ray Serve."""

__version__ = "0.1.0"
