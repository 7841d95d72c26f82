"""Where outputs live: publishing a build or store whole or not at all (`output`), object storage
(`remote`), and the local cache through which a loader reads a remote build (`cache`)."""
