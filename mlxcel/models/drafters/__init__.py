"""MTP drafters: one file per head, loaded beside (or from inside) the target checkpoint."""

from .loader import DrafterError, DrafterSpec, load_drafter

__all__ = ["DrafterError", "DrafterSpec", "load_drafter"]
