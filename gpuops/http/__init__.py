"""The engine's HTTP server: /metrics, /healthz, and the routes other parts mount."""

from gpuops.http.server import Health, HttpServer, Mount

__all__ = ["Health", "HttpServer", "Mount"]
