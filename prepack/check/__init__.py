"""Reading a finished build back (no torch): `verify` proves it intact, `report` (`prepack inspect`) says
how well it packed."""
