"""Feature sources (inline, threaded, point-to-point), the worker processes and their launcher."""
