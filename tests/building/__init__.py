"""Tests of building: reading, tokenizing, planning, writing packs and stores, the engines."""
