"""A client's request as the router holds it: parsed and validated once (client_request.py), and the errors
it can end with, each family one HTTP status (errors.py, mapped in api/errors.py)."""
