"""Where a build's documents come from (building wing, no torch): a corpus of token ids (`corpus`), text
or chat tokenized on the way (`tokenize`), or a document store tokenized before (`store`); `documents`
opens whichever a build names, so `build` and `build_store` read one way."""
