"""Shared pytest configuration: fixed seeds and a headless matplotlib backend."""

import os

os.environ.setdefault("MPLBACKEND", "Agg")
