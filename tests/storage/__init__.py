"""Tests of where output goes: publishing locally and in object storage, the shard cache."""
