"""How the code runs: devices, weights files, atomic writes, processes, progress, memory.

Imports nothing else of the package but `errors` and `registry`."""
