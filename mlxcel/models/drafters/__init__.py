"""What every family's drafter shares: the spec, the header and inventory checks, loading and quantization.

The heads themselves live with their families (:mod:`mlxcel.families`).
"""

from .loader import DrafterError, DrafterSpec, finish_drafter

__all__ = ["DrafterError", "DrafterSpec", "finish_drafter"]
