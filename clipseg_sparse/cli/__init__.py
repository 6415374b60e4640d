"""The `clipseg-sparse` command line: one module per command group, assembled in `app.py`.

The top floor: imports anything below, and nothing imports it."""

from .app import app, main

__all__ = ["app", "main"]
