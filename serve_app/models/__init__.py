"""Plain-PyTorch models and their checkpoint I/O (the bottom layer of the Serve app). Import
from the modules themselves: this package imports nothing, so reading a config (kimi_config,
dspark_config) does not load torch."""
