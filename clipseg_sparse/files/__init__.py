"""Inputs and outputs on disk: image discovery, folder runs, output files, result records.

May import `datasets`, `segment` and below."""
