"""Building (no torch): the `build` and `build_store` commands (`build`), the packing planner (`plan`), the
writers of pack shards (`write_shards`) and of a document store (`write_store`), and the engines that run
their steps in this process or on Ray (`engines`)."""
