"""Published methods, one room each: presets, stages, protocol, constants and notes (see README.md).

May import `evaluation` and below; nothing below imports a method (the registries name this package)."""
