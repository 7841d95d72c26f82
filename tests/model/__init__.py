"""Tests of the model side: enable_packing, the family table and its sweep, per-document layers, GPU kernels."""
