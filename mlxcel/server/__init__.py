"""The HTTP layer: a quart-trio app over the engine's public API. Never imports mlx."""

from .app import create_app, create_embedding_app
from .context import ServerOptions

__all__ = ["ServerOptions", "create_app", "create_embedding_app"]
