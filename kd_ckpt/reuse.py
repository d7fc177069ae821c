"""Reuse unchanged leaves (issue 13): placeholder until implemented."""

from __future__ import annotations


def prune(directory) -> None:
  del directory
