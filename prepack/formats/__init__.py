"""The two on-disk formats, each one description that its writers and readers share: pack shards and their
manifest (`shards`, schemas/shard-format.md) and the document store (`store`, schemas/store-format.md), over
the rules both use (`common`: strict JSON, regular files, one Arrow IPC reader, problems and errors)."""
