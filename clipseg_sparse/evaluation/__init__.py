"""Scores: benchmark evaluation (`evaluate`), protocols, metrics, FG-OVD.

May import `files`, `datasets`, `segment` and below."""
