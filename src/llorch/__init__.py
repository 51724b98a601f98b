"""llorch: one process, one device, one model, served over HTTP with live streaming."""

__version__ = "0.1.0"
