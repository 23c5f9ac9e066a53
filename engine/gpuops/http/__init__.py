"""The engine's HTTP server: /metrics, /healthz, and the routes other parts mount.

May import: nothing but the root.
"""

from gpuops.http.server import Health, HttpServer, Mount

__all__ = ["Health", "HttpServer", "Mount"]
