"""Old name of pool/served_model.py, kept only for gateway.py until its split updates the import."""

# TODO(lead): remove after gateway split
from dpd_router.pool.served_model import ServedModel

__all__ = ["ServedModel"]
