"""Training (torch): a build as a dataset (`dataset`), which packs each rank trains on (`sampler`,
`balance`), the batch (`collate`), exact loss weighting (`loss`), context parallelism
(`context_parallel`) and the throughput that counts real tokens only (`throughput`)."""
