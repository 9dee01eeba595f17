"""lmstack's OpenAI-compatible HTTP server: `lmstack serve STACK`."""

from lmstack_api.app import create_app
from lmstack_api.server import serve

__all__ = ["create_app", "serve"]
