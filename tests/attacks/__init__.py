"""Tests of hostile and malformed input: every outcome a named error, never a traceback or a hang."""
