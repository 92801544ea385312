"""Old name of client_request.py, kept only for gateway.py until its split updates the import."""

# TODO(lead): remove after gateway split
from dpd_router.client_request import ClientRequest

__all__ = ["ClientRequest"]
