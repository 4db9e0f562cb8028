"""The K3 chat path: request handling, XTML rendering and output parsing."""
