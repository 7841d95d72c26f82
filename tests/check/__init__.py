"""Tests of verify and inspect."""
