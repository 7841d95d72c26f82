"""Tests of the project as a user meets it: the CLI, its help, extras, the public API, the layout, README and examples."""
