"""Tests of the two formats: pack shards and the document store, their specs, schemas and golden bytes."""
