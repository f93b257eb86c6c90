"""The router role (``mlxcel serve --node-role router``): a model-free front for serving nodes.

It imports no mlx: it forwards requests over HTTP (httpx) and reads the nodes'
``/health``, ``/v1/internal/mtp-policy`` and load endpoints.
"""
