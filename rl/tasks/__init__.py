"""Synthetic tasks the project generates itself (nothing is downloaded)."""
