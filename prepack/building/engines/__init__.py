"""The engines of `build` and `build_store`: one protocol (`base`), run in this process (`local`) or as Ray
tasks across a cluster (`ray`), writing the same bytes."""
