"""Several models in one server: which ones and by which names (:mod:`.catalog`), which stay loaded
(:mod:`.residency`), and the ASGI front that picks one per request (:mod:`.front`)."""

from .catalog import (
           MODEL_OPTIONS,
           Catalog,
           CatalogError,
           ModelEntry,
           catalog,
           discover,
           parse_duration,
           read_models_file,
)

__all__ = ["MODEL_OPTIONS", "Catalog", "CatalogError", "ModelEntry", "catalog", "discover", "parse_duration",
           "read_models_file"]
